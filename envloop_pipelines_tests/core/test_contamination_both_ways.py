"""Rule 7 at every door: contamination measured both ways, on every snapshot any arm trains on, and a user's
generator kept from the label files (issue 23, items 5 and 7).

* A test state inside a longer row (padded with as many other words, or put in the instructions) is found:
  the share of the hidden record's 13-grams contained in the row, not only the share of the row's found in
  the hidden splits.
* Template text that every record carries (shared instructions) flags no row.
* The null arms and release 1 train on the checked snapshot (flagged rows removed, report stored beside it).
* A ``module:attr`` generator runs in the sandbox: what it reads of the label folder there is nothing, and
  its rows are checked like every other row.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from envloop_pipelines.core.data.contamination import ContaminationConfig, check_contamination

from .data.test_records import good_record, write_lines
from .label_probe import read_labels

_FILLER = ("apple river stone cloud pencil garden window mirror candle ladder basket forest engine violin tunnel "
           "harbor meadow copper silver velvet marble lantern compass orchard canyon glacier falcon dolphin").split()


def _padded(state: str, rng: random.Random) -> str:
    """``state`` and then as many filler words as it has."""
    return state + " " + " ".join(rng.choice(_FILLER) for _ in state.split())


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from envloop_pipelines.core.benchmark.builtin_task import generate_builtin_task
    from envloop_pipelines.core.data.snapshots import open_task

    home = tmp_path_factory.mktemp("builtin")
    generate_builtin_task(task="personal_agent", n_users=60, records_per_user=2, home=home)
    return open_task("personal_agent", home=home)


def _hidden(task: Any) -> list[tuple[str, list[str]]]:
    from envloop_pipelines.core.data.contamination import record_texts

    return [e for split in ("test", "holdout") for e in record_texts(task.table(split), split)]


def test_a_test_state_inside_a_longer_row_is_flagged(builtin: Any) -> None:
    """Verbatim test states padded with as many filler words: 0/20 flagged before (the row's 13-grams were
    at most half in test), 20/20 now (each state's 13-grams are all in its row)."""
    rng = random.Random(0)
    states = list(dict.fromkeys(s for split in ("test", "holdout")
                                for s in builtin.table(split).column("state_text").to_pylist()))[:20]
    assert len(states) == 20
    reference = [(f"test/{i}", s) for i, s in enumerate(states)]  # plain strings: the old signature too
    padded = [(f"p{i}", _padded(s, rng)) for i, s in enumerate(states)]
    report = check_contamination(padded, reference)
    assert len(report.flagged_rows) == 20 and len(report.containment) == 20
    assert all(f["containment"] == 1.0 and f["matches"] == f"test/{f['row']}" for f in report.containment)
    # the row-side share alone stays near a half or below: the test that missed them
    assert report.ngram_overlap == [] or all(f["overlap"] < 0.6 for f in report.ngram_overlap)

    # the state put in the instructions the model also reads, under a short state of its own
    in_instructions = [(f"q{i}", ("A short state of its own.", s)) for i, s in enumerate(states)]
    found = check_contamination(in_instructions, _hidden(builtin))
    assert found.exact == found.near_duplicate == found.ngram_overlap == []
    assert [f["row"] for f in found.containment] == list(range(20))


def test_the_builtin_train_split_is_not_flagged_by_containment(builtin: Any) -> None:
    """No false positives from the new direction on real rows: the train split's users are not in test."""
    from envloop_pipelines.core.data.contamination import row_texts

    report = check_contamination(row_texts(builtin.table("train")), _hidden(builtin))
    assert report.containment == [] and report.n_reference_unmeasured == 0
    assert report.n_reference == sum(len(set(builtin.table(s).column("record_id").to_pylist()))
                                     for s in ("test", "holdout"))


def test_instructions_every_record_shares_flag_no_row() -> None:
    """A long instruction template on every row and every hidden record is template text, not content."""
    rng = random.Random(1)
    template = ("Read the whole ticket below with care and decide which of the listed options the support team "
                "should take next, keeping in mind the customer's history, the stated policy of the shop, the "
                "order in which messages arrived, and anything the customer says about earlier attempts, then "
                "answer with one option only and nothing else at all")
    assert len(template.split()) > 50

    def state(k: int) -> str:
        return f"Ticket {k}: " + " ".join(rng.choice(_FILLER) + str(rng.randrange(10**6)) for _ in range(30))

    hidden = [(f"test/{k}", [state(k), template]) for k in range(30)]
    rows = [(f"r{k}", (state(100 + k), template)) for k in range(30)]
    assert check_contamination(rows, hidden).clean
    # counted as content, the template alone would contain most of each hidden record in every row
    loose = check_contamination(rows, hidden, ContaminationConfig(boilerplate_max_records=10**9))
    assert len(loose.containment) == 30
    # and a hidden state inside one of these rows is still found
    leaked = [("x", (hidden[3][1][0] + " " + " ".join(_FILLER), template))]
    assert check_contamination(leaked, hidden).containment[0]["matches"] == "test/3"


def _contaminated_task(root: Path) -> tuple[Any, int]:
    """30 users x 2 records; every first record shares one state, so train copies of it match test/holdout."""
    from envloop_pipelines.core.data.datasets import import_file

    records = []
    for u in range(30):
        for k in range(2):
            rec = good_record(f"r{u}-{k}", user=f"u{u}")
            rec["state"] = ("the shared state of every first ticket" if k == 0
                            else f"ticket {u} of user u{u}: " + " ".join(_FILLER[(u + i) % len(_FILLER)] for i in range(8)))
            records.append(rec)
    snap = import_file(write_lines(root / "d.jsonl", records), "tickets", home=root / "home")
    shared = sum(1 for s in snap.table("train").column("state_text").to_pylist() if s.startswith("the shared"))
    assert 0 < shared < snap.table("train").num_rows
    return snap, shared


def test_null_arms_refuse_unchecked_data_before_any_training(tmp_path: Path) -> None:
    """Policy ``refuse`` and flagged base rows: the floor is refused before a single arm trains."""
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.decision_loop.noise_floor import ContaminatedDataError, measure_noise_floor
    from envloop_pipelines.core.ledger.store import RoundStore
    from envloop_pipelines.core.tracking import MlflowTracker

    snap, shared = _contaminated_task(tmp_path)
    home = tmp_path / "home"
    config = LoopConfig(task="tickets", home=str(home), noise_arms=2, safety_families=(), contamination_policy="refuse",
                        recipe_overrides={"max_steps": 1, "max_length": 64})
    with pytest.raises(ContaminatedDataError, match=f"{shared} rows overlap test/holdout.*contamination_policy='refuse'"):
        measure_noise_floor(config, snap, MlflowTracker(home=home))
    assert list(Ledger("tickets", str(home)).events()) == []
    store = RoundStore("tickets", str(home))
    assert not store.checkpoints.exists() or not any(store.checkpoints.iterdir())


@pytest.mark.slow
def test_null_arms_and_release_1_train_on_the_checked_snapshot(tmp_path: Path) -> None:
    """Before: the arms trained on raw ``train`` (data hash = the task snapshot id), shared states and all."""
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.ledger.ledger import Ledger
    from envloop_pipelines.core.decision_loop.noise_floor import measure_noise_floor
    from envloop_pipelines.core.tracking import MlflowTracker

    snap, shared = _contaminated_task(tmp_path)
    home = tmp_path / "home"
    config = LoopConfig(task="tickets", home=str(home), noise_arms=2, safety_families=(),
                        recipe_overrides={"max_steps": 1, "max_length": 64})
    measured = measure_noise_floor(config, snap, MlflowTracker(home=home))
    shas = {arm["training_snapshot"] for arm in measured.floor.arms}
    assert len(shas) == 1
    sha = shas.pop()
    assert sha != snap.snapshot_id
    data_dir = home / "artifacts" / "snapshots"
    rows = pq.read_table(data_dir / f"{sha}.parquet")
    assert rows.num_rows == snap.table("train").num_rows - shared
    assert not any(s.startswith("the shared") for s in rows.column("state_text").to_pylist())
    report = json.loads((data_dir / f"{sha}.contamination.json").read_text())
    assert report["removed_base_rows"] == shared and report["final"]["clean"] and report["policy"] == "remove"
    for arm in measured.floor.arms:  # the checkpoint records what it trained on
        assert arm["contamination_removed"] == shared
        assert json.loads((Path(arm["checkpoint"]) / "data.json").read_text())["data_hash"] == sha
    (card,) = Ledger("tickets", str(home)).releases()
    assert card["data_snapshot"] == sha and card["checkpoint_sha256"] == measured.floor.arms[0]["checkpoint_sha256"]


def test_a_user_generator_reads_nothing_of_the_labels_and_its_rows_are_checked(tmp_path: Path) -> None:
    """``generator=module:attr`` runs in the sandbox. Before, it ran in the loop's process, as the owner of the
    0400 label files, and read them whole (shown here in-process)."""
    from envloop_pipelines.core.loop.config import LoopConfig
    from envloop_pipelines.core.decision_loop.failure_mining import FailureCluster
    from envloop_pipelines.core.decision_loop.training_dataset_snapshot import checked_training_snapshot
    from envloop_pipelines.core.decision_loop.synthesis import SandboxedGenerator, SynthesisRequest, load_generator

    snap, _ = _contaminated_task(tmp_path)
    home = tmp_path / "home"
    label_dir = home / "verifier"
    assert read_labels(str(label_dir))["bytes"] > 0  # the loop's own user can: this is what a generator must not
    leak = snap.table("test").column("state_text").to_pylist()[-1]
    assert not leak.startswith("the shared")
    kwargs = {"label_dir": str(label_dir), "leak_state": leak, "filler": " ".join(_FILLER[:12])}
    spec = "envloop_pipelines_tests.core.label_probe:LabelProbe"
    generator = load_generator(spec, home=home, **kwargs)
    assert isinstance(generator, SandboxedGenerator) and generator.name == "label_probe"
    cluster = FailureCluster(key={"family": "route"}, n=4, errors=2, confident_errors=1, error_rate=0.5,
                             excess_errors=1.0, example_ids=("a",))
    train = snap.table("train")
    clean = train.filter(pc.invert(pc.starts_with(train.column("state_text"), "the shared")))
    rows = generator.synthesize(SynthesisRequest(round="r0001", clusters=(cluster,), n_examples=2, seed=1), clean)
    assert generator.last_run["uid"] != 0 and generator.last_run["hidden_paths_masked"]
    got = json.loads(rows.column("instructions_text")[0].as_py())
    assert got["bytes"] == 0 and got["files"] == [] and got["errors"], got
    config = LoopConfig(task="tickets", home=str(home))
    checked = checked_training_snapshot(config, snap, rows, round="r0001")
    report = json.loads(Path(checked.path).with_suffix(".contamination.json").read_text())
    assert report["removed_synthesized_rows"] == 1 and checked.n_synthesized == 1
    assert [f["id"] for f in report["checked"]["containment"]] == [rows.column("record_id")[1].as_py()]


def test_a_user_generator_is_refused_where_the_sandbox_cannot_hide_the_labels() -> None:
    from envloop_pipelines.core.decision_loop.synthesis import SandboxRefusedError, load_generator
    from envloop_pipelines.core.sandbox import LocalSandbox

    with pytest.raises(SandboxRefusedError, match="'envloop_pipelines.core.decision_loop.synthesis:VariantGenerator' is user code"):
        load_generator("envloop_pipelines.core.decision_loop.synthesis:VariantGenerator", sandbox=LocalSandbox(switch_uid=False))
