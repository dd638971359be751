"""The `mxplus` entry point: a subcommand that cannot import stays listed and says why."""

from __future__ import annotations

import importlib

import pytest

from vllm_mxplus import cli


def _fail_import(monkeypatch: pytest.MonkeyPatch, target: str, err: ImportError) -> None:
    real = importlib.import_module

    def fake(name: str, *args, **kwargs):
        if name == target:
            raise err
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cli.importlib, "import_module", fake)


def test_all_subcommands_import() -> None:
    parser = cli.build_parser()
    text = parser.format_help()
    for command in cli.SUBCOMMANDS:
        assert command in text
    assert "unavailable" not in text


def test_missing_optional_dependency_is_named(monkeypatch, capsys) -> None:
    err = ModuleNotFoundError("No module named 'lm_eval'", name="lm_eval")
    _fail_import(monkeypatch, cli.SUBCOMMANDS["eval"], err)
    assert "needs the Python package 'lm_eval'" in cli.build_parser().format_help()
    assert cli.main(["eval", "configs/x.yaml"]) == 1
    out = capsys.readouterr().err
    assert "mxplus eval: unavailable: needs the Python package 'lm_eval'" in out
    assert "Traceback" not in out


def test_import_error_from_a_bug_is_not_swallowed(monkeypatch, capsys) -> None:
    err = ImportError("cannot import name 'nope' from 'vllm_mxplus.formats'")
    _fail_import(monkeypatch, cli.SUBCOMMANDS["qsnr"], err)
    assert cli.main(["qsnr", "--synthetic"]) == 1
    out = capsys.readouterr().err
    assert "ImportError: cannot import name 'nope'" in out
    assert "a bug: please report it" in out
    assert "quantize" in cli.build_parser().format_help()  # the others still load


def test_internal_module_not_found_is_a_bug(monkeypatch, capsys) -> None:
    err = ModuleNotFoundError("No module named 'vllm_mxplus.gone'", name="vllm_mxplus.gone")
    _fail_import(monkeypatch, cli.SUBCOMMANDS["prepare"], err)
    assert cli.main(["prepare"]) == 1
    assert "a bug: please report it" in capsys.readouterr().err
