"""Issue #20's bar on a simulated fleet: four real `maced` processes (tiny model) on loopback, each
joined by its own Flower SuperNode (TLS, registered node key) to one SuperLink running the
aggregator's ServerApp (`flwr run`). Users on three devices share one preference (answers that
start with "The"); two devices also hold a private one from users who gave feedback consent but
not fleet consent; the fourth device has no feedback for the shared preference at all.

After two rounds (FedAvg, or the trimmed mean) the shared preference is learned on the fourth device (its greedy answers
satisfying it at least double, to at least half), the private ones do not move its answers (they
never enter a round: fleet consent is what lets a pair out, `fleet_material`; the trimmed mean's
share is tests/fleet/test_fleet_rounds.py), what the devices sent is tensors and numbers only
and holds none of the feedback's text, and after a device's users withdraw fleet consent it
contributes nothing to the next round. Memory-pressure shedding is the device side's test:
tests/daemon/test_fleet_round.py (a shed round answers num_examples 0, which weighs nothing here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daemon.sdk import Client
from tests.daemon.conftest import DaemonProcess
from tests.fleet.harness import LoopbackFleet

pytestmark = pytest.mark.slow

SHARED = "The"  # one token of the tiny tokenizer: a preference the tiny model can learn in a round
PRIVATE = {"d0": "Hello there, from the first device", "d1": "Paris is where the second device is"}
DAEMON_FLAGS = ["--set", "fleet.enabled=true", "--set", "finetune.enabled=false",
                "--set", "feedback.heldout_fraction=0.0",
                # The mechanics with a handful of devices: one fleet user each and noise 0.001, below
                # the device's default terms (docs/fleet.md), which are lowered here.
                "--set", "fleet.min_noise_multiplier=0.001", "--set", "fleet.min_users=1",
                "--set", "fleet.min_examples=1", "--set", "fleet.min_heldout_pairs=1",
                "--set", "fleet.epsilon_budget=inf", "--set", "fleet.evaluate_per_hour=1000"]
RUN = {"rounds": 2, "min-devices": 4, "strategy": "fedavg", "rank": 4, "alpha": 8.0,
       "targets": "q_proj,v_proj", "steps": 12, "lr": 0.05, "clip": 10.0, "noise-multiplier": 0.001,
       "heldout-fraction": 0.25, "max-pairs": 64, "seed": 3, "timeout-s": 600.0}
# The tiny random model's next-token distribution is nearly flat (307 tokens, every log-prob
# within about a nat) and its final norm bounds how far a q/v adapter can lift one token, so after
# the rounds "The" leads the runner-up by a fraction of a nat and the greedy share is all or nothing
# (lead_of prints the lead). At 8 steps of lr 0.01 under noise 0.01 (the noise's norm, std 0.05 over
# the adapter's 1,792 values, about the update's ~2.2) the lead was 0.25 nats here and negative in
# one CI run (share 0.0). At 12 steps of lr 0.05, the updates clipped at 10 (the device's default
# max_clip) and noise 0.001 it led by 0.42; four runs at 8-12 steps, lr 0.02-0.05 and noise 0.001
# led by 0.26-0.67.
EVAL_PROMPTS = [f"Evaluation prompt {j}: what would you say about number {j * 13}?" for j in range(10)]


def teach(c: Client, user: str, answer: str, n: int, *, fleet: bool) -> list[str]:
    """`n` edits of `user` wanting `answer`; returns the texts the device now holds for them."""
    c.consent(user, fleet=True if fleet else None)
    texts = []
    for i in range(n):
        prompt = f"Question {i} from {user}: tell me about item {i * 7 + len(user)} please"
        r = c.generate(prompt, max_tokens=2, temperature=1.0, seed=i, user=user)
        c.edit(user, r.interaction_id, answer)
        texts += [prompt, answer]
    return texts


def lead_of(c: Client, prefix: str) -> float:
    """How far (nats) the first greedy token leads the best token other than `prefix`'s, or
    trails it when `prefix` is not first: the mean over the evaluation prompts (a diagnostic)."""
    leads = []
    for p in EVAL_PROMPTS:
        top = c.generate(p, max_tokens=1, temperature=0.0, logprobs=5).candidates[0].logprobs[0]["top"]
        mine = [lp for _, lp, b in top if b.startswith(prefix.encode())]
        other = [lp for _, lp, b in top if not b.startswith(prefix.encode())]
        leads.append((mine[0] if mine else top[-1][1]) - other[0])
    return sum(leads) / len(leads)


def share_starting(c: Client, prefix: str) -> float:
    """The share of greedy answers to the evaluation prompts that start with `prefix` (no user:
    the base model with the fleet adapter, what a new user gets)."""
    answers = [c.generate(p, max_tokens=2, temperature=0.0).text for p in EVAL_PROMPTS]
    return sum(a.startswith(prefix) for a in answers) / len(answers)


@pytest.fixture
def devices(tmp_path: Path, tiny_model_dir: Path):
    started = []
    for i in range(4):
        root = tmp_path / f"d{i}"
        root.mkdir()
        started.append(DaemonProcess(root, tiny_model_dir, extra_args=DAEMON_FLAGS))
    for d in started:
        d.wait_ready()
    yield dict(zip(("d0", "d1", "d2", "d3"), started, strict=True))
    for d in started:
        d.stop()


def run_fleet(fleet: LoopbackFleet, tmp_path: Path, tiny_model_dir: Path, **overrides: object) -> None:
    config = {**RUN, "model": str(tiny_model_dir), "round-log": str(tmp_path / "rounds.jsonl"),
              "audit-dir": str(tmp_path / "audit"), "state-dir": str(tmp_path / "aggregator-state"), **overrides}
    done = fleet.run(config, timeout_s=900)
    assert done.returncode == 0 and "ServerApp raised" not in done.stdout, done.stdout[-6000:] + done.stderr[-3000:]


# FedAvg end to end. Flower's trimmed mean (one value of three cut per coordinate, the median) ran
# this same test green too (margin 0 -> 0.78 -> 0.96); it is kept out of the default suite for its
# ~3 minutes, and tests/fleet/test_fleet_rounds.py runs it through the same ServerApp in-process.
@pytest.mark.parametrize("strategy", [{"strategy": "fedavg"}], ids=["fedavg"])
def test_a_fleet_learns_the_shared_preference_without_sharing_feedback(
        devices: dict[str, DaemonProcess], tmp_path: Path, tiny_model_dir: Path, strategy: dict) -> None:
    texts: list[str] = []
    for name, shared_user in (("d0", "ann"), ("d1", "ben"), ("d2", "cat")):
        with devices[name].client(timeout_s=60) as c:
            texts += teach(c, shared_user, SHARED, 8, fleet=True)
            if name in PRIVATE:
                texts += teach(c, f"{shared_user}-own", PRIVATE[name], 8, fleet=False)
    with devices["d3"].client(timeout_s=60) as c:  # fleet consent, but no feedback at all
        c.consent("dan", fleet=True)
        shared_before = share_starting(c, SHARED)
        private_before = {n: share_starting(c, p[:5]) for n, p in PRIVATE.items()}

    fleet = LoopbackFleet(tmp_path / "flower")
    try:
        fleet.start_superlink()
        for name, d in devices.items():
            # The staging dir inside the daemon's publish folder; its operator key beside it.
            fleet.join(name, {"maced-endpoint": d.endpoint, "staging-dir": str(d.state_dir / "fleet-staging")})
        for name in devices:
            fleet.wait_joined(name)
        run_fleet(fleet, tmp_path, tiny_model_dir, **strategy)

        rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
        assert [r["round"] for r in rounds] == [1, 2]
        node = {v: k for k, v in fleet.nodes.items()}
        for r in rounds:
            status = {node[d["node"]]: d["status"] for d in r["devices"]}
            assert status == {"d0": "trained", "d1": "trained", "d2": "trained", "d3": "no_material"}, r
            assert r["contributing"] == 3
        assert any(r["published"] for r in rounds), rounds
        assert "epsilon" in fleet.log("supernode-d0") and "fleet round 1: trained" in fleet.log("supernode-d0")

        with devices["d3"].client(timeout_s=60) as c:
            assert c.fleet_status()["serving"] is not None
            shared_after = share_starting(c, SHARED)
            private_after = {n: share_starting(c, p[:5]) for n, p in PRIVATE.items()}
            lead = lead_of(c, SHARED)
        print(f"\nshared preference on the device without its feedback: {shared_before:.2f} -> {shared_after:.2f} "
              f"(its first token leads by {lead:.2f} nats); "
              f"private ones: {private_before} -> {private_after}; rounds: "
              + json.dumps([{k: r[k] for k in ("round", "examples", "metrics_before", "metrics_after", "published")}
                            for r in rounds]))
        assert shared_after >= max(2 * shared_before, 0.5)
        assert private_after == private_before

        # What left the devices, as the aggregator received it: tensors and numbers only.
        audit = tmp_path / "audit"
        summaries = sorted(audit.glob("*-train-*.json"))
        assert len(summaries) == 8
        for summary_path in summaries:
            summary = json.loads(summary_path.read_text())
            assert set(summary["arrays"]) == {"arrays"} and set(summary["metrics"]) == {"metrics"}
            assert summary["configs"] == {}
            assert all(a["dtype"] == "float32" for a in summary["arrays"]["arrays"].values())
            assert all(isinstance(v, (int, float)) for v in summary["metrics"]["metrics"].values())
        sent = b"".join(p.read_bytes() for p in audit.glob("*.bin"))
        for text in {t for t in texts if len(t) >= 8}:  # "The" alone would match float bytes by chance
            assert text.encode() not in sent, text

        # Fleet consent withdrawn on d2: it sends no delta and weighs nothing in the next round.
        with devices["d2"].client(timeout_s=60) as c:
            c.consent("cat", granted=None, fleet=False)
        run_fleet(fleet, tmp_path, tiny_model_dir, rounds=1, **strategy)
        third = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])
        assert third["round"] == 3
        entry = {node[d["node"]]: d for d in third["devices"]}
        assert entry["d2"]["status"] == "no_material" and entry["d2"]["examples"] == 0
        assert third["contributing"] == 2 and third["examples"] == entry["d0"]["examples"] + entry["d1"]["examples"]
        d2_sent = json.loads(next(audit.glob(f"003-train-{fleet.nodes['d2']}.json")).read_text())
        assert d2_sent["arrays"]["arrays"] == {} and d2_sent["metrics"]["metrics"]["num-examples"] == 0
    finally:
        fleet.stop()
