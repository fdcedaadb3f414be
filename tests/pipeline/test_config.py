"""Configuration layering: preset < file < RLPIPE_ environment < --set flags."""

import pytest

from pipeline.config import ConfigError, config_to_json, preset_names, resolve_config


def test_layers_in_order(tmp_path):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("run_id: from-file\nlearner:\n  learning_rate: 0.01\n  lora_rank: 4\n")
    env = {"RLPIPE_LEARNER__LEARNING_RATE": "0.02", "RLPIPE_BUS__BOOTSTRAP_SERVERS": "k1:9092,k2:9092"}
    cfg = resolve_config("cartpole", cfg_file, ["learner.lora_rank=2"], environ=env)
    assert cfg.run_id == "from-file"  # file over preset
    assert cfg.env.name == "cartpole"  # preset
    assert cfg.learner.learning_rate == 0.02  # env over file
    assert cfg.learner.lora_rank == 2  # flag over file
    assert cfg.bus.bootstrap_servers == "k1:9092,k2:9092"


def test_env_lists_are_json_decoded():
    cfg = resolve_config(environ={"RLPIPE_LEARNER__TARGET_MODULES": '["q_proj","v_proj"]'})
    assert cfg.learner.target_modules == ["q_proj", "v_proj"]


def test_bad_value_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides=["learner.learning_rate=-1"])
    assert "learner.learning_rate" in str(info.value) and "\n" not in str(info.value)


def test_a_yes_or_no_for_a_number_is_refused_and_every_mistake_is_named_at_once(tmp_path):
    """YAML reads ``yes`` as true, which pydantic's lax mode took for the number 1: a budget of one step."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("learner:\n  max_steps: yes\n  learning_rate: -1\n  lora_rank: 4\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(config_file=cfg_file, overrides=["value.learner.batch_size=false"])
    message = str(info.value)
    assert "learner.max_steps: Value error, max_steps is yes (a yes/no), not a number" in message
    assert "learner.learning_rate" in message and "\n" not in message  # both mistakes, one line
    assert resolve_config(overrides=["learner.max_steps=7", "learner.gradient_checkpointing=yes"]).learner.max_steps == 7


def test_unknown_key_refused():
    with pytest.raises(ConfigError, match=r"learner\.learnig_rate"):
        resolve_config(overrides=["learner.learnig_rate=0.1"])


def test_a_misspelt_key_in_a_file_or_set_is_refused_naming_the_closest_field(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides=["learner.lerning_rate=0.1", "lerner.max_steps=3"])
    message = str(info.value)
    assert "learner.lerning_rate: no such setting; did you mean learner.learning_rate?" in message, message
    assert "lerner: no such setting; did you mean learner?" in message and "\n" not in message
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("value:\n  learner:\n    bach_size: 8\n")  # a section that is absent by default
    with pytest.raises(ConfigError, match=r"value\.learner\.bach_size: no such setting; did you mean "
                                          r"value\.learner\.batch_size\?"):
        resolve_config("dqn-cartpole", cfg_file)
    with pytest.raises(ConfigError, match=r"learner\.zzz: no such setting \(rlpipe config show lists them\)"):
        resolve_config(overrides=["learner.zzz=1"])


def test_incompatible_options_rejected_up_front():
    with pytest.raises(ConfigError, match="max_loras"):
        resolve_config(overrides=["producer.max_staleness=5", "sampler.max_loras=2"])


def test_importance_losses_refuse_sampling_they_cannot_correct_for():
    for overrides, match in [
        (["sampler.top_p=0.9"], "sampler.top_p"),
        (["sampler.temperature=0", "learner.loss=ppo"], "greedy"),
    ]:
        with pytest.raises(ConfigError, match=match) as info:
            resolve_config(overrides=overrides)
        assert "\n" not in str(info.value).strip()
    assert resolve_config(overrides=["sampler.temperature=0.7"]).sampler.temperature == 0.7
    assert resolve_config(overrides=["sampler.top_p=0.9", "learner.loss=awr"]).sampler.top_p == 0.9


def test_secret_never_printed():
    cfg = resolve_config(environ={
        "RLPIPE_BUS__SECURITY_PROTOCOL": "SASL_SSL", "RLPIPE_BUS__SASL_MECHANISM": "PLAIN",
        "RLPIPE_BUS__SASL_USERNAME": "alice", "RLPIPE_BUS__SASL_PASSWORD": "hunter2-secret"})
    assert cfg.bus.sasl_password.get_secret_value() == "hunter2-secret"
    for text in (config_to_json(cfg), repr(cfg), str(cfg)):
        assert "hunter2-secret" not in text


def test_sasl_needs_mechanism():
    with pytest.raises(ConfigError, match="sasl_mechanism"):
        resolve_config(environ={"RLPIPE_BUS__SECURITY_PROTOCOL": "SASL_SSL"})


def test_presets_cover_every_environment():
    assert {"cartpole", "sokoban", "tetris", "acrobot", "text2sql", "building-hvac",
            "recsim-interest-evolution"} <= set(preset_names())
    for name in preset_names():
        assert resolve_config(name).env.name


def test_unknown_preset_and_missing_file():
    with pytest.raises(ConfigError, match="unknown preset 'nope'; choose one of"):
        resolve_config("nope")
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_config(config_file="/no/such/file.yaml")


@pytest.mark.parametrize("name", ["../presets/cartpole", "sub/../cartpole", "ABSOLUTE"])
def test_a_preset_name_that_is_a_path_is_refused(tmp_path, name):
    """A preset is a name, never a path: ``--preset ../presets/cartpole`` (or an absolute path) would read a YAML
    file outside the shipped presets; ``--config`` is the way to read a file."""
    (tmp_path / "mine.yaml").write_text("env: {name: cartpole}\n")
    name = str(tmp_path / "mine") if name == "ABSOLUTE" else name
    with pytest.raises(ConfigError, match=r"preset .* is not a preset name.*choose one of.*--config"):
        resolve_config(name)


def test_a_config_path_that_is_a_folder_or_not_text_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=f"config file '{tmp_path}' is a folder; give the path of a YAML or JSON file"):
        resolve_config(config_file=str(tmp_path))
    binary = tmp_path / "run.yaml"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00\xf0\x9f")
    with pytest.raises(ConfigError, match=f"config file '{binary}' is not text .*; give a YAML or JSON file"):
        resolve_config(config_file=str(binary))


def test_env_variable_with_a_misspelt_section_is_refused_naming_the_closest():
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={"RLPIPE_LERNER__LEARNING_RATE": "1e-4"})
    message = str(info.value)
    assert "RLPIPE_LERNER__LEARNING_RATE" in message and "RLPIPE_LEARNER__LEARNING_RATE" in message
    assert "\n" not in message


def test_env_variable_with_a_misspelt_field_is_refused_naming_the_closest():
    with pytest.raises(ConfigError, match="RLPIPE_LEARNER__LEARNING_RATE"):
        resolve_config(environ={"RLPIPE_LEARNER__LEARNIG_RATE": "1e-4"})
    with pytest.raises(ConfigError, match="RLPIPE_RUN_ID"):
        resolve_config(environ={"RLPIPE_RUNID": "x"})


def test_env_variables_that_are_not_configuration_are_accepted():
    cfg = resolve_config(environ={"RLPIPE_HOME": "/tmp/x", "RLPIPE_KAFKA_GROUP_TIMINGS_MS": "{}",
                                  "RLPIPE_FAULT": "after_checkpoint:1", "RLPIPE_KAFKA_PORT": "9092",
                                  "RLPIPE_ENV__OVERRIDES__MAX_TURNS": "5", "RLPIPE_LEARNER__LORA_RANK": "4"})
    assert cfg.env.overrides == {"max_turns": "5"} and cfg.learner.lora_rank == 4  # the env coerces its own fields


def test_group_size_one_with_group_relative_advantages_is_refused():
    with pytest.raises(ConfigError, match="group_size") as info:
        resolve_config(overrides=["producer.group_size=1"])
    assert "\n" not in str(info.value) and "advantage" in str(info.value)
    with pytest.raises(ConfigError, match="group_size"):
        resolve_config(overrides=["producer.group_size=1", "learner.advantage=return_to_go"])
    resolve_config(overrides=["producer.group_size=1", "learner.advantage=raw"])
    resolve_config(overrides=["producer.group_size=1", "learner.advantage=return_to_go",
                              "learner.return_to_go_baseline=step"])
    resolve_config(overrides=["producer.group_size=1", "learner.loss=cross_entropy"])


def test_producer_staleness_beyond_the_learners_is_refused():
    with pytest.raises(ConfigError, match="max_staleness") as info:
        resolve_config(overrides=["producer.max_staleness=3", "learner.max_staleness=1", "sampler.max_loras=4"])
    assert "learner.max_staleness" in str(info.value) and "\n" not in str(info.value)
    resolve_config(overrides=["producer.max_staleness=1", "learner.max_staleness=3"])


def test_config_show_says_what_empty_broker_and_store_fields_resolve_to(tmp_path, monkeypatch):
    import json as _json
    from datetime import UTC, datetime

    from typer.testing import CliRunner

    from pipeline.cli.config_cmd import app as config_app
    from pipeline.devstack import stack

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    for name in ("RLPIPE_BUS__BOOTSTRAP_SERVERS", "RLPIPE_STORE__ROOT"):
        monkeypatch.delenv(name, raising=False)
    running = stack.StackState(pid=1, bootstrap_servers="127.0.0.1:40123", store_root=f"file://{tmp_path}/store",
                               home=str(tmp_path), log_dir=str(tmp_path), started_at=datetime.now(UTC))
    monkeypatch.setattr(stack, "read_stack_state", lambda home=None: running)
    result = CliRunner().invoke(config_app, ["show", "--preset", "cartpole"])
    assert result.exit_code == 0, result.output
    assert _json.loads(result.stdout)["bus"]["bootstrap_servers"] == ""  # the configuration as written
    assert "bus.bootstrap_servers -> 127.0.0.1:40123" in result.stderr
    assert f"store.root -> file://{tmp_path}/store" in result.stderr
    given = CliRunner().invoke(config_app, ["show", "--preset", "cartpole", "--set", "bus.bootstrap_servers=k:9092",
                                            "--set", "store.root=memory://x"])
    assert "note:" not in given.stderr


def test_a_language_model_learner_setting_on_a_value_run_is_refused_naming_the_value_one(tmp_path):
    """`--set learner.max_steps=30` on a DQN preset used to be accepted and do nothing (the value learner trains to
    value.learner.max_steps): it is refused, naming the field that does apply."""
    for layers in ({"overrides": ["learner.max_steps=30"]}, {"environ": {"RLPIPE_LEARNER__LEARNING_RATE": "0.1"}}):
        with pytest.raises(ConfigError) as info:
            resolve_config("dqn-cartpole", **layers)
        line = str(info.value)
        assert "\n" not in line and "value run" in line
        assert ("value.learner.max_steps" in line) == ("overrides" in layers)
    with pytest.raises(ConfigError, match=r"learner\.lora_rank.*value\.learner"):
        resolve_config("cql-building", overrides=["learner.lora_rank=4"])  # no value field of that name
    cfg = resolve_config("dqn-cartpole", overrides=["learner.torch_threads=1", "value.learner.max_steps=30"])
    assert cfg.learner.torch_threads == 1 and cfg.value.learner.max_steps == 30  # what a value run does read
    assert resolve_config("cartpole", overrides=["learner.max_steps=30"]).learner.max_steps == 30


def test_every_rlpipe_variable_the_code_reads_is_accepted_by_the_configuration():
    """A process variable the code reads (RLPIPE_API_KEYS, ...) that the configuration refused stopped every command
    where it was set: each one named in the source must be a field or in PROCESS_ENV."""
    import re
    from pathlib import Path

    from pipeline.config import PROCESS_ENV, config_env_names

    root = Path(__file__).resolve().parents[2]
    read = {name for package in ("pipeline", "producers", "consumers", "schemas")
            for path in (root / package).rglob("*.py")
            for name in re.findall(r"[\"'](RLPIPE_[A-Z0-9_]+)[\"']", path.read_text())}
    assert "RLPIPE_API_KEYS" in read
    assert not read - config_env_names() - set(PROCESS_ENV)
    resolve_config(environ=dict.fromkeys(read - config_env_names(), "x"))


def test_kubernetes_service_links_of_services_named_rlpipe_are_not_configuration():
    """Kubernetes gives each pod <SERVICE>_SERVICE_HOST, <SERVICE>_PORT_9092_TCP, ... for every Service in its
    namespace: a Service named rlpipe-kafka-bootstrap or rlpipe-api must not stop rlpipe from starting."""
    links = {"RLPIPE_KAFKA_BOOTSTRAP_SERVICE_HOST": "10.96.0.10", "RLPIPE_KAFKA_BOOTSTRAP_SERVICE_PORT": "9093",
             "RLPIPE_KAFKA_BOOTSTRAP_SERVICE_PORT_TCP_REPLICATION": "9091",
             "RLPIPE_KAFKA_BOOTSTRAP_PORT": "tcp://10.96.0.10:9093",
             "RLPIPE_KAFKA_BOOTSTRAP_PORT_9093_TCP": "tcp://10.96.0.10:9093",
             "RLPIPE_KAFKA_BOOTSTRAP_PORT_9093_TCP_PROTO": "tcp", "RLPIPE_KAFKA_BOOTSTRAP_PORT_9093_TCP_PORT": "9093",
             "RLPIPE_KAFKA_BOOTSTRAP_PORT_9093_TCP_ADDR": "10.96.0.10", "RLPIPE_API_SERVICE_HOST": "10.96.0.11",
             "RLPIPE_API_PORT": "tcp://10.96.0.11:80"}
    assert resolve_config("cartpole", environ=links).env.name == "cartpole"
    with pytest.raises(ConfigError, match="RLPIPE_LEARNER__LEARNING_RATE"):  # a misspelt field is still refused
        resolve_config(environ={**links, "RLPIPE_LEARNER__LEARNIG_RATE": "1e-4"})
    with pytest.raises(ConfigError, match="RLPIPE_RUN_ID"):
        resolve_config(environ={"RLPIPE_RUNID": "x"})


def test_an_environment_name_or_setting_it_does_not_have_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """`--set env.overrides.widht=8` used to be accepted by every command and fail only when a producer built the
    environment: the commands that resolve a run refuse it in one line naming the field."""
    from typer.testing import CliRunner

    from pipeline.cli.config_cmd import app as config_app
    from pipeline.cli.options import run_config

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    runner = CliRunner()
    for setting, named in (("env.overrides.widht=8", "widht"), ("env.overrides.width=1000", "width"),
                           ("env.name=nope", "nope")):
        result = runner.invoke(config_app, ["show", "--preset", "tetris", "--set", setting])
        assert result.exit_code == 2 and named in result.output, result.output
        assert "\n" not in result.output.strip()
    misspelt = runner.invoke(config_app, ["show", "--preset", "tetris", "--set", "env.overrides.widht=8"]).output
    assert "env.overrides of tetris: widht: no such setting; did you mean width?" in misspelt, misspelt
    assert "sokoban" in runner.invoke(config_app, ["show", "--set", "env.name=nope"]).output  # the names there are
    assert run_config("tetris", None, ["env.overrides.width=8"]).env.overrides == {"width": 8}
    assert run_config(None, None, [], None).env.name == "cartpole"


def test_config_presets_shows_every_name_whole_on_an_80_column_terminal():
    """A preset name cut short (`recsim-interest-evolut…`) cannot be copied into --preset."""
    from typer.testing import CliRunner

    from pipeline.cli.config_cmd import app as config_app

    shown = CliRunner(env={"COLUMNS": "80"}).invoke(config_app, ["presets"])
    assert shown.exit_code == 0 and "…" not in shown.output, shown.output
    names = {line.split("│")[1].strip() for line in shown.output.splitlines() if line.startswith("│")}
    assert set(preset_names()) <= names


def test_a_value_run_is_configured_by_environment_variables_like_any_other_section():
    """RLPIPE_VALUE was accepted as a field's name and then dropped (the run stayed a LoRA run), and
    RLPIPE_VALUE__LEARNER__MAX_STEPS was refused as a variable that sets no field."""
    config = resolve_config(environ={"RLPIPE_VALUE": '{"observation_size": 4, "num_actions": 2}'})
    assert config.value is not None and config.value.num_actions == 2
    config = resolve_config("dqn-cartpole", environ={"RLPIPE_VALUE__LEARNER__MAX_STEPS": "7",
                                                     "RLPIPE_VALUE__ACTOR__FINAL_EPSILON": "0.1"})
    assert (config.value.learner.max_steps, config.value.actor.final_epsilon) == (7, 0.1)
    with pytest.raises(ConfigError, match="RLPIPE_VALUE__LEARNER__MAX_STEPS"):
        resolve_config("dqn-cartpole", environ={"RLPIPE_VALUE__LEARNER__MAX_STEP": "7"})
    from pipeline.config import _EnvLayer
    from schemas.config import RunConfig

    assert set(RunConfig.model_fields) <= set(_EnvLayer.model_fields)  # no accepted name is read and dropped


def test_a_set_value_over_fields_another_set_gave_merges_a_mapping_and_refuses_anything_else():
    """`--set learner.learning_rate=1 --set learner=3` dropped the first silently (the other order was refused)."""
    from pipeline.config import parse_overrides

    with pytest.raises(ConfigError, match=r"--set 'learner=3': learner already has fields set by another --set"):
        parse_overrides(["learner.learning_rate=1", "learner=3"])
    merged = parse_overrides(["env.overrides.size=6", 'env.overrides={"boxes": 2}'])
    assert merged == {"env": {"overrides": {"size": 6, "boxes": 2}}}


def test_a_set_value_that_is_not_yaml_or_a_key_under_a_value_is_one_line_naming_the_flag():
    """`--set 'env.overrides={bad'` used to end in a YAML traceback, and `--set learner=3 --set learner.x=1` in a
    TypeError: both are the user's to fix, named in one line."""
    with pytest.raises(ConfigError, match=r"--set 'env.overrides=\{bad': the value is not valid YAML"):
        resolve_config("cartpole", overrides=["env.overrides={bad"], environ={})
    with pytest.raises(ConfigError, match=r"--set 'learner.learning_rate=1': learner is already set to 3"):
        resolve_config("cartpole", overrides=["learner=3", "learner.learning_rate=1"], environ={})
    with pytest.raises(ConfigError, match=r"--set 'learner..x=1': the key has an empty part"):
        resolve_config("cartpole", overrides=["learner..x=1"], environ={})


def test_lower_case_rlpipe_names_are_read_like_the_process_environment_reads_them(monkeypatch):
    """Names are matched whatever their case, as pydantic-settings matches the process's own variables."""
    assert resolve_config(environ={"rlpipe_learner__max_steps": "7"}).learner.max_steps == 7
    monkeypatch.setenv("rlpipe_learner__max_steps", "9")
    assert resolve_config().learner.max_steps == 9  # the process environment, read by pydantic-settings
    assert resolve_config(environ={}).learner.max_steps != 9  # an explicit environ replaces the process's
    with pytest.raises(ConfigError, match="RLPIPE_LEARNER__LEARNING_RATE"):
        resolve_config(environ={"rlpipe_learner__learnig_rate": "1e-4"})


def test_one_name_given_in_two_cases_with_different_values_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"RLPIPE_LEARNER__MAX_STEPS.*rlpipe_learner__max_steps") as info:
        resolve_config(environ={"RLPIPE_LEARNER__MAX_STEPS": "7", "rlpipe_learner__max_steps": "8"})
    assert "\n" not in str(info.value)
    assert resolve_config(environ={"RLPIPE_LEARNER__MAX_STEPS": "7", "rlpipe_learner__max_steps": "7"}
                          ).learner.max_steps == 7


def test_a_process_variable_written_in_another_case_is_refused_naming_its_exact_name():
    """``RLPIPE_API_KEYS``, ``RLPIPE_HOME`` and the other ``PROCESS_ENV`` names are read by their exact name
    (``os.environ.get``): one written in lower case would be accepted here and then ignored where it is read, e.g. a
    gateway open to any key while ``rlpipe_api_keys`` names its tenants."""
    for name in ("rlpipe_api_keys", "Rlpipe_Home", "rlpipe_api_max_sessions"):
        with pytest.raises(ConfigError, match=rf"{name}.*{name.upper()}") as info:
            resolve_config(environ={name: "x"})
        assert "\n" not in str(info.value)
    assert resolve_config(environ={"RLPIPE_API_KEYS": "team-a=tml-k"}).learner.lora_rank > 0


@pytest.mark.parametrize("text", ["off", "on", "yes", "no", "2024", "1"])
def test_a_text_field_set_to_what_yaml_reads_as_a_yes_no_or_a_number_keeps_the_text(text: str, tmp_path) -> None:
    """``--set run_id=off`` was refused ("run_id: Input should be a valid string"): YAML 1.1 reads off/on/yes/no
    as booleans and 2024 as a number.  Only true/false are booleans (YAML 1.2), and a text field keeps a number as
    the text written; the same in a config file."""
    assert resolve_config(preset="cartpole", overrides=[f"run_id={text}"]).run_id == text
    path = tmp_path / "run.yaml"
    path.write_text(f"run_id: {text}\nproducer:\n  producer_id: {text}\n")
    config = resolve_config(preset="cartpole", config_file=str(path))
    assert (config.run_id, config.producer.producer_id) == (text, text)


def test_yes_no_words_still_set_a_boolean_field_and_are_still_refused_for_a_number() -> None:
    config = resolve_config(preset="cartpole", overrides=["learner.normalize_advantage_std=off"])
    assert config.learner.normalize_advantage_std is False
    assert resolve_config(preset="cartpole", overrides=["learner.normalize_advantage_std=yes"]
                          ).learner.normalize_advantage_std is True
    with pytest.raises(ConfigError, match=r"max_steps is yes \(a yes/no\)"):
        resolve_config(preset="cartpole", overrides=["learner.max_steps=yes"])
    with pytest.raises(ConfigError, match=r"learner.max_steps: .*max_steps is true \(a yes/no\)"):
        resolve_config(preset="cartpole", overrides=["learner.max_steps=true"])


@pytest.mark.parametrize(("settings", "match"), [
    ({"SASL_MECHANISM": "SCRAM-SHA-512", "SASL_USERNAME": "alice", "SASL_PASSWORD": "pw"},
     r"bus.sasl_mechanism.*security_protocol is PLAINTEXT.*SASL_PLAINTEXT or SASL_SSL"),
    ({"SECURITY_PROTOCOL": "SSL", "SASL_USERNAME": "alice"}, r"bus.sasl_username.*security_protocol is SSL"),
    ({"SECURITY_PROTOCOL": "SASL_PLAINTEXT", "SASL_MECHANISM": "PLAIN", "SASL_USERNAME": "alice",
      "SSL_CAFILE": "/etc/ca.pem"}, r"bus.ssl_cafile.*security_protocol is SASL_PLAINTEXT.*SSL or SASL_SSL"),
])
def test_security_settings_the_protocol_would_ignore_are_refused(settings: dict[str, str], match: str) -> None:
    """The Kafka client drops SASL settings under a non-SASL protocol, and TLS ones under a plaintext one: the
    client would connect without them and fail (or succeed) for a reason nobody sees."""
    with pytest.raises(ConfigError, match=match) as info:
        resolve_config(environ={f"RLPIPE_BUS__{name}": value for name, value in settings.items()})
    assert "\n" not in str(info.value).strip()


def test_a_password_alone_under_a_plaintext_bus_is_accepted_as_a_pod_holding_its_secret() -> None:
    """A deployment may give every pod the Kafka Secret whatever its bus; the password is then unused."""
    config = resolve_config(environ={"RLPIPE_BUS__SASL_PASSWORD": "pw"})
    assert config.bus.security_protocol == "PLAINTEXT" and config.bus.sasl_password is not None


def test_a_bad_value_from_the_environment_names_its_variable():
    with pytest.raises(ConfigError) as caught:
        resolve_config("cartpole", environ={"RLPIPE_BUS__CONNECT_TIMEOUT_S": "-1"})
    assert "bus.connect_timeout_s" in str(caught.value) and "RLPIPE_BUS__CONNECT_TIMEOUT_S" in str(caught.value)
    # set again by --set, the value that fails is the command line's: no variable is blamed
    with pytest.raises(ConfigError) as caught:
        resolve_config("cartpole", overrides=["bus.connect_timeout_s=-2"], environ={"RLPIPE_BUS__CONNECT_TIMEOUT_S": "-1"})
    assert "RLPIPE_" not in str(caught.value)


def test_a_section_set_as_one_variable_names_it_and_how_to_set_its_fields():
    with pytest.raises(ConfigError) as caught:
        resolve_config("cartpole", environ={"RLPIPE_LEARNER": "3"})
    message = str(caught.value)
    assert "RLPIPE_LEARNER='3'" in message and "RLPIPE_LEARNER__" in message and "\n" not in message
