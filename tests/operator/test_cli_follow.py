"""The `--wait` loop shared by `kvpilot reset` and `kvpilot weights update` (pure logic: the object's reads
are a scripted sequence; tests/operator/test_operator_reset_ux.py and test_operator_weights.py run it against a real API server)."""

from __future__ import annotations

import io

import pytest
from kubernetes.client.rest import ApiException

from kvpilot.operator.cli import RESET
from kvpilot.operator.cli_follow import follow
from kvpilot.operator.weights.cli import UPDATE


class Reads:
    """Answers get_namespaced_custom_object with the next scripted status (an exception is raised)."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)

    def get_namespaced_custom_object(self, group: str, version: str, ns: str, plural: str, name: str) -> dict:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return {"status": answer}


def run(what, *answers: object) -> tuple[int, str]:
    out = io.StringIO()
    rc = follow(Reads(*answers), "ns", "x", what, float("inf"), out, (ApiException,))
    return rc, out.getvalue()


def test_update_lines_move_with_the_pods_and_end_on_degraded() -> None:
    staging = {
        "phase": "Staging",
        "pods": [{"name": "a", "result": "Pending"}, {"name": "b", "result": "Staged"}],
    }
    done = {
        "phase": "Degraded",
        "progress": "1/2",
        "version": "v2",
        "pods": [
            {"name": "a", "result": "Fenced", "message": "commit: gone"},
            {"name": "b", "result": "Succeeded"},
        ],
        "conditions": [
            {"type": "Degraded", "status": "True", "reason": "CommitFailed", "message": "a fenced"}
        ],
    }
    rc, text = run(UPDATE, staging, staging, done)
    assert rc == 1
    lines = text.splitlines()
    assert lines[0] == "phase Staging" and lines.count("phase Staging") == 1
    assert sum(line.lstrip().startswith("b ") for line in lines) == 2  # Staged, then Succeeded
    assert "phase Degraded: 1/2 pods on v2" in lines and lines[-1] == "Degraded: CommitFailed: a fenced"


@pytest.mark.parametrize("what", [RESET, UPDATE], ids=["reset", "weights"])
def test_a_deleted_object_ends_the_wait_with_2(what, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _ = run(what, {"phase": "Running"}, ApiException(status=404, reason="Not Found"))
    assert rc == 2
    assert f"{what.kind} ns/x was deleted" in capsys.readouterr().err


def test_reset_prints_successes_only_at_the_end() -> None:
    pods = [{"name": "a", "result": "Succeeded"}, {"name": "b", "result": "Failed", "message": "HTTP 500"}]
    running = {"phase": "Running", "targets": 2, "progress": "1/2", "failed": 1, "pods": pods}
    done = dict(
        running, phase="Failed", progress="2/2", conditions=[{"status": "True", "reason": "PodsFailed"}]
    )
    rc, text = run(RESET, running, done)
    assert rc == 1
    first_a = next(i for i, line in enumerate(text.splitlines()) if line.lstrip().startswith("a "))
    assert first_a > text.splitlines().index("phase Failed: 2/2 pods reset, 1 failed, 0 skipped")


def test_reset_shows_verdicts_and_the_verified_condition_before_its_end() -> None:
    pods = [
        {"name": "a", "result": "Succeeded", "epoch": 2, "verified": "cold"},
        {
            "name": "b",
            "result": "Failed",
            "reason": "StillWarm",
            "verified": "warm",
            "message": "b served 300",
        },
    ]
    done = {
        "phase": "Failed",
        "targets": 2,
        "progress": "1/2",
        "failed": 1,
        "verified": "1/2",
        "pods": pods,
        "conditions": [  # Verified first: the final line is still the reset's end
            {
                "type": "Verified",
                "status": "False",
                "reason": "StillWarm",
                "message": "1/2 pods still served",
            },
            {"type": "Failed", "status": "True", "reason": "PodsFailed", "message": "1/2 pods reset"},
        ],
    }
    rc, text = run(RESET, done)
    lines = text.splitlines()
    assert rc == 1 and lines[0] == "phase Failed: 1/2 pods reset, 1 failed, 0 skipped, 1/2 verified cold"
    assert any(line.lstrip().startswith("a ") and line.endswith("verified cold") for line in lines)
    assert any(line.lstrip().startswith("b ") and "b served 300 verified warm" in line for line in lines)
    assert lines[-2:] == [
        "Verified False: StillWarm: 1/2 pods still served",
        "Failed: PodsFailed: 1/2 pods reset",
    ]
