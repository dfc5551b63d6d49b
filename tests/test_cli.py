"""The `kvpilot` command line: flags generated from the config dataclasses keep the dataclasses' defaults,
abbreviated flags are refused, and a config's validate() error comes out as one line naming the flags."""

from __future__ import annotations

import logging

import pytest

from kvpilot.cli.bench import BenchSettings
from kvpilot.cli.flags import flag_message, from_flags
from kvpilot.cli.main import build_parser, main
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.server.settings import ServerSettings
from kvpilot.router.settings import RouterSettings


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def test_flag_defaults_are_the_dataclass_defaults() -> None:
    serve = parse("serve")
    assert from_flags(EngineConfig, serve) == EngineConfig()
    assert from_flags(ServerSettings, serve) == ServerSettings()
    assert from_flags(RouterSettings, parse("router", "--endpoints", "http://a:1")) == RouterSettings()
    assert from_flags(BenchSettings, parse("bench")) == BenchSettings()


def test_vllm_flag_names_and_aliases_set_their_fields() -> None:
    args = parse(
        "serve",
        "--num-gpu-blocks-override",
        "7",
        "-dp",
        "2",
        "-tp",
        "3",
        "--no-enable-prefix-caching",
        "--served-model-name",
        "a",
        "b",
        "--max-request-body-bytes",
        "9",
        "-O3",
        "--enforce-eager",
    )
    config, settings = from_flags(EngineConfig, args), from_flags(ServerSettings, args)
    assert (config.compilation_config, config.enforce_eager) == ("3", True)
    assert config.compilation("cuda").level == 0  # --enforce-eager wins, as vLLM's does
    assert (config.num_kv_blocks, config.data_parallel_size, config.tensor_parallel_size) == (7, 2, 3)
    assert config.enable_prefix_caching is False
    assert settings.served_model_names == ["a", "b"] and settings.max_body_bytes == 9
    assert (
        from_flags(RouterSettings, parse("router", "--fleet", "f", "--reset-timeout", "5")).reset_timeout_s
        == 5
    )
    assert from_flags(BenchSettings, parse("bench", "--no-reset")).reset is False


@pytest.mark.parametrize(
    "argv",
    [
        ["reset", "llm", "--timeout-second", "5"],  # --timeout-seconds
        ["serve", "--max-num-seq", "4"],  # --max-num-seqs
        ["router", "--endpoints", "http://a:1", "--reset-time", "5"],  # --reset-timeout
        ["bench", "--min-req", "2"],  # --min-requests
        ["--log-lev", "DEBUG", "bench"],  # --log-level
    ],
)
def test_abbreviated_flags_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert "error:" in capsys.readouterr().err  # argparse's: the handler never ran


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-model-len", "-5"], "--max-model-len must be positive"),
        (["--request-timeout", "0"], "--request-timeout must be a positive number of seconds"),
        (["-dp", "2", "-tp", "2"], "--data-parallel-size and --tensor-parallel-size cannot be combined yet"),
        (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override must be positive"),
        (["--kv-events-replay-endpoint", "tcp://127.0.0.1:1"], "a KV events replay endpoint needs"),
        (["-O7"], "compilation level must be one of 0, 1, 2, 3, not 7"),
        (["--compilation-config", '{"levle": 1}'], "unknown keys ['levle']"),
        (["-O", "1", "-tp", "2"], "a compiled step and --tensor-parallel-size > 1 cannot be combined yet"),
        (
            ["--engine-process", "-tp", "3"],
            "--engine-process and --tensor-parallel-size > 1 cannot be combined yet",
        ),
    ],
)
def test_serve_refuses_bad_flags_in_one_line_before_loading_anything(
    argv: list[str], message: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVPILOT_ADMIN_TOKEN", raising=False)
    with caplog.at_level(logging.ERROR):
        assert main(["serve", *argv]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and message in errors[0], errors


def test_validate_messages_name_fields_for_python_callers() -> None:
    with pytest.raises(ValueError, match="^num_kv_blocks must be positive$") as exc:
        EngineConfig(num_kv_blocks=0).validate()
    assert flag_message(exc.value, EngineConfig) == "--num-gpu-blocks-override must be positive"
    with pytest.raises(ValueError, match="policy must be one of"):
        RouterSettings(policy="fastest").validate()
