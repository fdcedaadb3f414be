"""Outside Kafka tools against the embedded broker, invoked exactly as the README shows them.

Users inspect topics with the tools they know.  kafka-python's console tools come with
rlpipe (kafka-python is a dependency), so they are always checked.  kcat and the
confluent-kafka client are checked where they are installed: both are built on
librdkafka, which before 2.2.0 misreads the broker's ApiVersions reply (it skips one
byte too few of each tagged field, and the broker sends its default-valued ones), so
older builds need the flags below and can only read from explicit offsets.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.io import bus
from pipeline.io.bus import EventPublisher
from pipeline.topics import topic_name
from schemas.config import BusConfig
from schemas.events import RunStopped, make_event

pytestmark = pytest.mark.integration

# For librdkafka < 2.2.0 (Debian 12's kcat 1.7.1 links 2.0.2): skip the ApiVersions request
# and speak the 0.9 protocol. Reading from offset 0 works; `-o beginning`/`end` (ListOffsets
# v0), consumer groups and producing do not.
KCAT_OLD_LIBRDKAFKA_FLAGS = ["-X", "api.version.request=false", "-X", "broker.version.fallback=0.9.0"]


@pytest.fixture
def control_events(bus_config: BusConfig) -> tuple[str, list[str]]:
    """Three events on the namespace's control topic: (topic, their event ids)."""
    bus.ensure_topics(bus_config)
    events = [make_event(f"run-{i}", RunStopped(reason=f"tools check {i}")) for i in range(3)]
    with EventPublisher(bus_config) as publisher:
        for event in events:
            publisher.publish("control", event)
    return topic_name(bus_config.namespace, "control"), [str(event.event_id) for event in events]


def run_tool(command: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)


def event_ids(lines: str) -> list[str]:
    """The ``event_id`` of each JSON line (other lines, such as tool chatter, are ignored)."""
    ids = []
    for line in lines.splitlines():
        if line.startswith("{"):
            ids.append(json.loads(line)["event_id"])
    return ids


def kafka_python_script() -> str:
    """The ``kafka-python`` console script of this environment (it comes with rlpipe's kafka-python)."""
    beside = Path(sys.executable).with_name("kafka-python")
    found = str(beside) if beside.exists() else shutil.which("kafka-python")
    assert found, "the kafka-python console script is missing: reinstall kafka-python>=3.0"
    return found


def test_kafka_python_console_tools_list_and_read_topics(bus_config, control_events):
    topic, ids = control_events
    tool = kafka_python_script()
    listed = run_tool([tool, "admin", "-b", bus_config.bootstrap_servers, "--format", "json", "topics", "list"])
    assert listed.returncode == 0, listed.stderr
    assert topic in json.loads(listed.stdout)
    consumed = run_tool([
        tool, "consumer", "-b", bus_config.bootstrap_servers, "-t", topic,
        "-C", "auto_offset_reset=earliest", "-C", "consumer_timeout_ms=3000",
    ])
    assert consumed.returncode == 0, consumed.stderr
    assert sorted(event_ids(consumed.stdout)) == sorted(ids)


def kcat_librdkafka_version() -> tuple[int, ...]:
    if shutil.which("kcat") is None:
        pytest.skip("kcat is not installed (Debian/Ubuntu: apt-get install kcat); kafka-python's tools are checked instead")
    version = run_tool(["kcat", "-V"]).stdout
    match = re.search(r"librdkafka (\d+)\.(\d+)\.(\d+)", version)
    assert match, f"kcat -V names no librdkafka version: {version!r}"
    return tuple(int(part) for part in match.groups())


def test_kcat_reads_topics_from_offset_0_with_any_librdkafka(bus_config, control_events):
    kcat_librdkafka_version()
    topic, ids = control_events
    kcat = ["kcat", *KCAT_OLD_LIBRDKAFKA_FLAGS, "-b", bus_config.bootstrap_servers]
    listed = run_tool([*kcat, "-L", "-J"])
    assert listed.returncode == 0, listed.stderr
    assert topic in {t["topic"] for t in json.loads(listed.stdout)["topics"]}
    consumed = run_tool([*kcat, "-C", "-t", topic, "-o", "0", "-e", "-q"])
    assert consumed.returncode == 0, consumed.stderr
    assert sorted(event_ids(consumed.stdout)) == sorted(ids)


def test_kcat_without_flags_needs_librdkafka_2_2(bus_config, control_events):
    topic, ids = control_events
    plain = ["kcat", "-b", bus_config.bootstrap_servers, "-C", "-t", topic, "-o", "beginning", "-e"]
    if kcat_librdkafka_version() >= (2, 2, 0):
        consumed = run_tool(plain)
        assert consumed.returncode == 0, consumed.stderr
        assert sorted(event_ids(consumed.stdout)) == sorted(ids)
    else:
        # What the README warns about; if this starts passing, the broker changed: update the README.
        failed = run_tool([*plain, "-m", "3"])
        assert failed.returncode != 0
        assert "Read underflow" in failed.stderr


def test_confluent_kafka_reads_topics(bus_config, control_events):
    confluent_kafka = pytest.importorskip(
        "confluent_kafka", reason="confluent-kafka is not installed (pip install confluent-kafka); not an rlpipe dependency"
    )
    topic, ids = control_events
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bus_config.bootstrap_servers, "group.id": "tools-check"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in partitions])
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while len(seen) < len(ids) and time.monotonic() < deadline:
            for message in consumer.consume(num_messages=len(ids), timeout=1):
                assert message.error() is None, message.error()
                seen.append(json.loads(message.value())["event_id"])
    finally:
        consumer.close()
    assert sorted(seen) == sorted(ids)
