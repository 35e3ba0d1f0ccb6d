"""Write data/golden/flash.json: the paper's France oracle for the real DeepSeek-V4-Flash checkpoint.

    python scripts/make_flash_golden.py

The ids and the hash are as reported by the paper (shared/paper_facts.md); the project's own trajectory hash of the
expected ids is computed beside it (they agree: the paper hashes ids the same way). The teacher-forced sequence is
the fixed pseudo-random sequence the harness uses for any config, long enough to cross the 2,048-position index
top-k boundary.
"""
import json
from pathlib import Path

from dsv4lab.core.config import get_preset
from dsv4lab.engine.sampling import trajectory_hash
from dsv4lab.tools.verify.model import GOLDEN_VERSION, boundaries, fixed_sequence, teacher_forced_length

PROMPT_IDS = [0, 128803, 3085, 344, 270, 6102, 294, 8760, 2755, 128804, 128822]
EXPECTED_IDS = [671, 6102, 294, 8760, 344, 2619, 51119, 42499, 1]
PAPER_HASH = "6f41fe2f01d52507"

args = get_preset("flash").replace(max_seq_len=4096)
golden = dict(
    version=GOLDEN_VERSION,
    checkpoint=dict(name="DeepSeek-V4-Flash"),
    recorded_with=dict(source="reported by the paper: DeepSeek-V4-Flash on AMD gfx90a (Media-Foundry/sglang-gfx90a, "
                              "reports/gfx90a-dsv4); stable across eager, graph replay and restarts there. "
                              "Not measured by dsv4lab."),
    oracles=[dict(name="France (paper)", prompt="(ids as reported: BOS, a user turn asking for the capital of France, the assistant turn in chat mode)",
                  prompt_ids=PROMPT_IDS, expected_ids=EXPECTED_IDS,
                  expected_text="The capital of France is Paris.", max_new_tokens=len(EXPECTED_IDS),
                  hash=trajectory_hash(EXPECTED_IDS), paper_hash=PAPER_HASH)],
    teacher_forced=dict(ids=fixed_sequence(args, teacher_forced_length(args)), boundaries=boundaries(args)),
)
assert golden["oracles"][0]["hash"] == PAPER_HASH
out = Path(__file__).resolve().parents[1] / "data" / "golden" / "flash.json"
out.write_text(json.dumps(golden, indent=1) + "\n")
print(f"wrote {out}")
