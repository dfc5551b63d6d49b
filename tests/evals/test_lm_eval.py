"""lm-evaluation-harness scores a multiple-choice task through a real `kvpilot serve` (its
`local-completions` backend: echo, logprobs, max_tokens 1, prompts as token ids) and the per-choice
loglikelihoods agree with its own `hf` backend on the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.servers import MODEL, start_server, stop_server

pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).parent
TASK = "kvpilot_tiny_mc"
# Both backends run the same fp32 weights; the sums differ only by the order of float operations.
MAX_ABS_DIFF = 1e-3


def write_task(folder: Path) -> None:
    data = HERE / "tiny_mc.jsonl"
    (folder / f"{TASK}.yaml").write_text(
        f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
    )


def loglikelihoods(results: dict) -> list[list[float]]:
    """Per document, the loglikelihood of each choice."""
    docs = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0]) for r in s["filtered_resps"]] for s in docs]


def test_local_completions_matches_hf(tmp_path: Path, default_model_dir: Path, monkeypatch) -> None:  # noqa: ANN001
    lm_eval = pytest.importorskip("lm_eval", reason="the test extra installs lm-eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    write_task(tmp_path)
    tasks = TaskManager(include_path=str(tmp_path))

    def evaluate(model: str, model_args: str, batch_size: int) -> dict:
        return lm_eval.simple_evaluate(
            model=model,
            model_args=model_args,
            tasks=[TASK],
            task_manager=tasks,
            batch_size=batch_size,
            log_samples=True,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
        )

    server = start_server(tmp_path)
    try:
        served = evaluate(
            "local-completions",
            f"model={MODEL},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={default_model_dir},max_retries=1,num_concurrent=2",
            batch_size=4,  # several token-id prompts per request
        )
    finally:
        stop_server(server)
    reference = evaluate("hf", f"pretrained={default_model_dir},dtype=float32,device=cpu", batch_size=4)

    ours, theirs = loglikelihoods(served), loglikelihoods(reference)
    assert len(ours) == 5 and all(len(row) == 4 for row in ours)
    diff = max(abs(a - b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b))
    print(json.dumps({"lm_eval_max_abs_diff": diff, "acc": served["results"][TASK]["acc,none"]}))
    assert diff < MAX_ABS_DIFF, (ours, theirs)
    assert served["results"][TASK]["acc,none"] == reference["results"][TASK]["acc,none"]
