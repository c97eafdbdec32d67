"""Tag names live in flywheel/tags.py: no other module of the project spells one, writer or reader."""

from __future__ import annotations

import ast
from pathlib import Path

from flywheel import tags

REPO = Path(__file__).resolve().parent.parent
NAMES = {value for key, value in vars(tags).items() if key.endswith("_TAG") and isinstance(value, str)}
# the families: what each function puts before its argument
FAMILIES = {fn("") for fn in (tags.stage_state_tag, tags.out_tag, tags.policy_tag, tags.gate_diff_tag,
                              tags.score_tag, tags.pass_rate_tag, tags.reference_tag, tags.dvc_tag)}
FAMILIES |= {tags.stage_run_tag("{}").partition("{}")[0]}


def _spelled(path: Path) -> list[str]:
    """Tag names spelled in a module: a string that is one, or an f-string that starts like a family's."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and node.value in NAMES:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
            if head in FAMILIES or head in NAMES or any(head.startswith(f) for f in FAMILIES if f.endswith(".")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: f{head!r}...")
    return found


def test_no_module_but_tags_spells_a_tag_name():
    files = [p for package in ("flywheel", "tasks", "flows") for p in sorted((REPO / package).rglob("*.py"))
             if p != REPO / "flywheel" / "tags.py"]
    spelled = [line for path in files for line in _spelled(path)]
    assert not spelled, "tag names written out of flywheel/tags.py:\n" + "\n".join(spelled)


def test_the_names_are_the_ones_stored_runs_carry():
    """Stored runs and versions, and searches of the registry, use these exact strings."""
    assert tags.gate_tag(True) == {"flywheel.gate": "passed"} and tags.gate_tag(False) == {"flywheel.gate": "failed"}
    assert tags.stage_state_tag("rl") == "stage.rl" and tags.stage_run_tag("rl") == "stage.rl.run_id"
    assert tags.out_tag("data/p/rl/rollouts.parquet") == "flywheel.out.data/p/rl/rollouts.parquet"
    assert tags.dvc_tag("data/p/collect") == "flywheel.dvc.data/p/collect"
    assert tags.score_tag("score_rl") == "flywheel.score.score_rl" and tags.pass_rate_tag("rl") == \
        "flywheel.pass_rate.rl"
    assert tags.reference_tag("oracle") == "flywheel.reference.oracle"
    assert tags.reference_tag("oracle", "pass_share") == "flywheel.reference.oracle.pass_share"
    assert (tags.PIPELINE_TAG, tags.STAGE_TAG, tags.MODEL_HASH_TAG) == \
        ("flywheel.pipeline", "flywheel.stage", "flywheel.model_hash")
