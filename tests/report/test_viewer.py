"""`grouprl view` without a browser: which directories are runs, what the server answers (and
refuses), and the exported file (the page's own behaviour is in test_viewer_browser.py)."""

from __future__ import annotations

import gzip
import http.client
import json

import pytest
from viewer_runs import HOSTILE, hostile_copy, record, short_run

from grouprl.cli import main
from grouprl.errors import UserError
from grouprl.report.viewer import ViewerServer, export_html, run_dirs, summary


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return short_run(tmp_path_factory.mktemp("viewer") / "gspo", "gspo", steps=2)


@pytest.fixture(scope="module")
def server(run):
    with_server = ViewerServer([run]).start()
    yield with_server
    with_server.close()


def get(server, path, host=None, gzip_ok=True):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    headers = {"Host": host or f"127.0.0.1:{server.port}"}
    if gzip_ok:
        headers["Accept-Encoding"] = "gzip"
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


def test_a_folder_of_runs_is_its_runs(run, tmp_path):
    assert run_dirs([run.parent]) == [run]
    assert run_dirs([run]) == [run]
    with pytest.raises(UserError, match="not a grouprl run directory"):
        run_dirs([tmp_path])
    with pytest.raises(UserError, match="does not exist"):
        run_dirs([tmp_path / "nothing"])


def test_the_summary_lists_the_logged_steps_and_the_curves(run):
    info = summary(run)
    assert info["steps"] == [1, 2] and info["note"] is None and info["finished"]
    assert info["settings"]["algo"] == "gspo" and info["settings"]["ratio_level"] == "sequence"
    assert info["curves"]["step"] == [1, 2] and len(info["curves"]["reward_mean"]) == 2
    assert info["evals"]["step"] == [0, 2]


def test_a_run_without_records_says_why(run, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.yaml").write_text((run / "config.yaml").read_text())
    (old / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    info = summary(old)
    assert info["steps"] == [] and "no groups/ records" in info["note"]


def test_the_server_sends_the_runs_a_step_and_the_vocabulary(server, run):
    status, headers, body = get(server, "/api/runs")
    assert status == 200 and json.loads(body)["runs"][0]["steps"] == [1, 2]
    status, headers, body = get(server, "/api/run/0/step/2")
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(body)) == record(run, 2)
    status, headers, body = get(server, "/api/run/0/step/2", gzip_ok=False)
    assert "Content-Encoding" not in headers and json.loads(body) == record(run, 2)
    status, _, body = get(server, "/api/run/0/vocab")
    assert status == 200 and "pieces" in json.loads(gzip.decompress(body))
    status, headers, body = get(server, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert b'id="grouprl-data"' not in body and b"function diverging" in body


@pytest.mark.parametrize(
    "path", ["/api/run/0/step/7", "/api/run/5/step/1", "/../config.yaml", "/api/run/0/step/..%2f",
             "/static/../../config.yaml", "/api/runs/../../etc/passwd"],
)  # fmt: skip
def test_the_server_serves_nothing_else(server, path):
    status, _, body = get(server, path)
    assert status == 404 and b"gspo" not in body


def test_the_server_refuses_another_host(server):
    """A page that made a name resolve to 127.0.0.1 (DNS rebinding) sends its own Host."""
    status, _, body = get(server, "/api/runs", host="attacker.example:80")
    assert status == 403 and b"runs" not in body


def test_an_export_holds_every_step_and_no_markup_from_the_model(run, tmp_path):
    hostile = hostile_copy(run, tmp_path / "hostile")
    out = tmp_path / "page.html"
    size = export_html([hostile], out)
    html = out.read_text()
    assert size == out.stat().st_size and html.count('id="grouprl-data"') == 1
    assert HOSTILE not in html and "<script>window.__pwned" not in html  # '<' is \\u003c in JSON
    data = json.loads(html.split('id="grouprl-data">', 1)[1].split("</script>", 1)[0])
    assert sorted(data["records"]["0"]) == ["1", "2"]
    assert data["records"]["0"]["1"]["groups"][0]["prompt"] == HOSTILE  # kept, as data
    only = export_html([hostile], tmp_path / "one.html", steps=[2])
    assert only < size


def test_the_command_exports_and_refuses_what_is_not_a_run(run, tmp_path, capsys):
    out = tmp_path / "view.html"
    assert main(["view", str(run), "--export", str(out)]) == 0
    assert out.is_file() and "1 run(s)" in capsys.readouterr().out
    assert main(["view", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]
    assert main(["view", str(run), "--steps", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["view", str(run), "--export", str(out), "--steps", "2", "7"]) == 2
    err = capsys.readouterr().err
    assert "--steps 7: not logged" in err and "logged steps: 1 2" in err
