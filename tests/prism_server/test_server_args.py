"""Settings as the command line and config files give them: a user's mistake is a message
naming the setting (exit 2, no traceback), never a setting dropped in silence."""

from __future__ import annotations

import socket

import pytest

from prism_server.cli.main import main, parse_args
from prism_server.server_args import ConfigError, check_listen, load_server_args

TINY = '[[models]]\nname = "m"\nsource = "dummy:tiny-llama"\n'


def test_serve_flags_before_serve_stay_and_before_another_command_are_refused(capsys):
    args = parse_args(["--port", "8332", "--policy", "static", "serve", "--config", "x"])
    assert (args.port, args.policy, args.config) == (8332, "static", "x")
    args = parse_args(["--model", "a=dummy:tiny-llama", "serve", "--model", "b=x"])
    assert args.models == ["a=dummy:tiny-llama", "b=x"]
    with pytest.raises(SystemExit) as e:
        main(["--port", "1", "generate", "--prompt", "hi"])
    assert e.value.code == 2 and "before `generate` are serve's" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, words",
    [
        (TINY + "ttft_slo_ms = nan\n", "ttft_slo_ms must be positive"),
        (TINY + "pinned = true\nkeep_alive_s = 1\n", "keep_alive_s does not apply"),
        (TINY + "max_cached_pages = -3\n", "max_cached_pages"),
        (TINY + "tensor_parallel = 4\n", "tensor_parallel = 4, but the engine has 1"),
        ("models = []\n", "models is empty"),
        (TINY + '[[engine.models]]\nname = "n"\nsource = "dummy:tiny-llama"\n', "[[models]] or"),
        ('[engine]\ndevice = "bogus"\n' + TINY, "device must be auto, cpu, cuda"),
        ("[engine]\nplan_interval_s = nan\n" + TINY, "plan_interval_s"),
        ("[engine]\npool_budget_bytes = 0\n" + TINY, "pool_budget_bytes must be positive"),
        ("max_request_bytes = -1\n" + TINY, "max_request_bytes must be positive"),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused_by_name(tmp_path, text, words):
    cfg = tmp_path / "prism.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=__import__("re").escape(words)):
        load_server_args(str(cfg))


def test_a_directory_or_bad_text_as_config_is_a_message(tmp_path):
    with pytest.raises(ConfigError, match="a directory, not a file"):
        load_server_args(str(tmp_path))
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_server_args(str(bad))


def test_where_it_cannot_listen_or_log_is_said_before_the_models_load(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        args = load_server_args(None, ["m=dummy:tiny-llama"], port=port)
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_listen(args)
    args = load_server_args(None, ["m=dummy:tiny-llama"], port=0, request_log=str(tmp_path))
    with pytest.raises(ConfigError, match="request_log"):
        check_listen(args)


def test_bench_arguments_are_checked_and_a_run_that_measured_nothing_fails(tmp_path, capsys):
    work = tmp_path / "w.csv"
    work.write_text("arrival_s,model,prompt_len,output_len\n0.0,m,8,4\n0.5,m,8,4\n")
    with pytest.raises(SystemExit):
        main(["bench", "run", "--workload", str(work), "--rate-scale", "0"])
    assert "expected a positive number" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as s:  # a port where nothing answers
        down = f"http://127.0.0.1:{s.getsockname()[1]}"
    assert main(["bench", "run", "--workload", str(work), "--url", down]) == 1
    assert "every request failed, the first with" in capsys.readouterr().err
    sweep = ["bench", "sweep", "--workload", str(work), "--out", str(tmp_path / "o")]
    assert main([*sweep, "--server-arg=--policy=swap"]) == 2
    assert "the sweep sets it itself" in capsys.readouterr().err


@pytest.mark.parametrize("slos", ['["a"]', '{"m": 5}', '{"m": {"ttft_s": 0, "tpot_s": 1}}'])
def test_a_malformed_slo_file_is_a_message(tmp_path, capsys, slos):
    (tmp_path / "slo.json").write_text(slos)
    work = tmp_path / "w.csv"
    work.write_text("arrival_s,model,prompt_len,output_len\n0.0,m,8,4\n")
    run = ["bench", "run", "--workload", str(work), "--slo-file", str(tmp_path / "slo.json")]
    assert main(run) == 2
    assert "slo.json" in capsys.readouterr().err


def test_status_says_when_the_url_is_no_prism_server(capsys):
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

        def log_message(self, *args):
            pass

    with http.server.HTTPServer(("127.0.0.1", 0), Other) as srv:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        assert main(["status", "--url", url]) == 2
        srv.shutdown()
    assert "not a Prism server's status" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["status", "--watch", "--interval", "-1"])
