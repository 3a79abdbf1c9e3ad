"""The partial-rollout demo comparison's report reads only its result files and pairs them by seed."""

import json

from sage_jax.experiments import partial_demo


def test_report_pairs_by_seed_from_the_files(tmp_path):
    for seed, (off, on) in enumerate([(0.30, 0.32), (0.40, 0.41), (0.35, 0.39)]):
        for arm, p1 in (("off", off), ("on", on)):
            record = {"arm": arm, "seed": seed, "after": {"test": {"pass@1": p1, "pass@16": 0.8}},
                      "token_lag_mean": 0.4 if arm == "on" else 0.0, "carried_rows": 3.0, "dropped_groups": 0,
                      "wall_s": 100.0}
            (tmp_path / f"{arm}_seed{seed}.json").write_text(json.dumps(record))
    (tmp_path / "on_seed3.json").write_text(json.dumps({"arm": "on", "seed": 3, "after": {}}))  # unpaired: left out
    text = partial_demo.report(str(tmp_path), 4)
    assert "seeds [0, 1, 2] paired" in text
    assert "| test | pass@1 | 0.350 | 0.373 | 0.023 ± 0.038" in text
    assert "| test | pass@16 | 0.800 | 0.800 | 0.000 ± 0.000" in text
    assert "mean token lag 0.400" in text and (tmp_path / "REPORT.md").exists()
