"""The staleness ablation's report picks each cell's learning rate by hand-computable rules: the
best last-3-evaluation mean among the rates run with the cell's most seeds, compared with eta = 0
at eta 0's own best rate, paired by seed."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from staleness_ablation import tuned_rows  # noqa: E402


def cell(eta, objective, lr, seed, *accs):
    return {"eta": eta, "objective": objective, "minibatches": 1, "lr": lr, "seed": seed,
            "curve": [(i, 0.0, a) for i, a in enumerate(accs)]}


CELLS = [
    # eta 0: 1e-4 averages 0.40, 5e-5 averages 0.45 -> 5e-5 is eta 0's best rate
    *(cell(0, "naive", 1e-4, s, 0.1, 0.4, 0.4, 0.4) for s in range(3)),
    cell(0, "naive", 5e-5, 0, 0.44, 0.44, 0.44),
    cell(0, "naive", 5e-5, 1, 0.46, 0.46, 0.46),
    cell(0, "naive", 5e-5, 2, 0.45, 0.45, 0.45),
    # decoupled at eta 4: 3 seeds at 1e-4 (0.30, 0.33, 0.36), one seed at 5e-5 (0.90)
    cell(4, "decoupled", 1e-4, 0, 0.30, 0.30, 0.30),
    cell(4, "decoupled", 1e-4, 1, 0.33, 0.33, 0.33),
    cell(4, "decoupled", 1e-4, 2, 0.36, 0.36, 0.36),
    cell(4, "decoupled", 5e-5, 0, 0.9, 0.9, 0.9),
]


def test_each_cell_at_its_best_rate_among_fully_seeded_rates():
    rows = {(r[1], r[2]): r for r in tuned_rows(CELLS)}
    *_, rates, best, seeds, vs = rows[("0", "naive")]
    assert (best, seeds, vs) == ("5e-05", "3", "")
    assert rates == "0.0001: 40.0%, 5e-05: 45.0%"
    *_, rates, best, seeds, vs = rows[("4", "decoupled")]
    # the one-seed 0.90 at 5e-5 cannot win over three seeds at 1e-4
    assert (best, seeds) == ("0.0001", "3")
    assert rates == "0.0001: 33.0%, 5e-05: 90.0% (1 seed)"
    # 0.33 - 0.45, and per seed 0.30-0.44, 0.33-0.46, 0.36-0.45
    assert vs == "-12.0% vs 5e-05 (-14.0 / -13.0 / -9.0)"
