"""Feedback becomes a new adapter version in a running daemon, which serves it, rolls it back,
and erases it with the user."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from daemon.sdk import Client
from tests.daemon.conftest import wait_for


def private_mode_violations(root: Path) -> list[str]:
    """Paths under `root` that the group or other users could read, write or enter."""
    bad = []
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        if not stat.S_ISLNK(info.st_mode) and info.st_mode & 0o077:
            bad.append(f"{path.relative_to(root)} {stat.filemode(info.st_mode)}")
    return bad


def test_feedback_trains_publishes_serves_rolls_back_and_forgets_an_adapter(start_daemon) -> None:
    """Also: under the usual umask 022 everything the daemon writes in its state dir stays the
    owner's (0700 / 0600), the erasure receipt counts the adapter folder, and the log never
    names the user (only a keyed pseudonym)."""
    previous = os.umask(0o022)  # inherited by the daemon, as from a login shell
    try:
        d = start_daemon(extra_args=["--set", "finetune.pairs_per_version=2",
                                     "--set", "feedback.heldout_fraction=0.0"])
    finally:
        os.umask(previous)
    with Client(d.endpoint, timeout_s=30) as c:
        c.consent("gina")
        for prompt in ("Say hi", "Say bye"):
            r = c.generate(prompt, max_tokens=6, n=2, temperature=1.0, seed=3, user="gina")
            assert r.recorded and r.adapter is None
            c.choose("gina", r.interaction_id, 1)
        # Published (served) first, then registered with the store; status counts it after both.
        # The engine thread publishes its stats after its next turn: wait for its counter too.
        status = wait_for(lambda: (s := c.status())["finetune"]["versions_published"]
                          and s["adapters"]["versions_served"] and s)
        adapters = c.adapters("gina")
        assert [(a["version"], a["active"], a["pairs"]) for a in adapters] == [(1, True, 2)]
        assert status["finetune"]["versions_published"] == 1 and status["finetune"]["pairs_trained"] == 2
        assert status["feedback"]["pairs_trained"] == 2 and status["feedback"]["adapter_versions"] == 1
        assert status["adapters"]["versions_served"] == 1
        assert (d.state_dir / "adapters" / "gina" / "v1").is_dir()

        served = c.generate("Say hi", max_tokens=3, user="gina")
        assert served.adapter == "gina@1"
        assert c.generate("Say hi", max_tokens=3, user="gina", adapter="base").adapter is None
        assert c.rollback("gina", 0)["serving"] is None
        assert c.generate("Say hi", max_tokens=3, user="gina").adapter is None

        for name in ("adapters", "costs", "feedback.sqlite3", "log-key"):
            assert (d.state_dir / name).exists(), name
        assert list((d.state_dir / "adapters" / "gina").rglob("adapter_config.json"))
        assert list((d.state_dir / "adapters" / "gina").rglob("events.jsonl"))
        assert private_mode_violations(d.state_dir) == []

        receipt = c.forget("gina")
        assert receipt["adapter_dir_removed"] is True and receipt["adapter_versions"] == 1
        assert c.adapters("gina") == []
        assert not (d.state_dir / "adapters" / "gina").exists()
        assert private_mode_violations(d.state_dir) == []
    code, _ = d.stop()
    assert code == 0
    log = d.log()
    assert "published adapter user:" in log and "gina" not in log


def test_greedy_answers_unchanged_while_the_engine_fine_tunes(start_daemon) -> None:
    """Fine-tune stages run inside the engine's iterations, beside inference: base-model greedy
    answers served before, during and after an adapter's training are the same text."""
    import threading

    d = start_daemon(extra_args=["--set", "finetune.pairs_per_version=3", "--set", "feedback.heldout_fraction=0.0"])
    prompt = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12,
              "temperature": 0.0, "ignore_eos": True}
    with Client(d.endpoint, timeout_s=30) as c:
        baseline = c.generate(**prompt).candidates[0].text
        assert c.status()["finetune"]["policy"] == "mace"
        answers: list[str] = []
        stop = threading.Event()

        def greedy_loop() -> None:
            with Client(d.endpoint, timeout_s=30) as g:
                while not stop.is_set():
                    answers.append(g.generate(**prompt).candidates[0].text)

        loop = threading.Thread(target=greedy_loop)
        loop.start()
        try:
            c.consent("hana")
            for i, text in enumerate(("Say hi", "Say bye", "Say thanks")):
                r = c.generate(text, max_tokens=6, n=2, temperature=1.0, seed=i, user="hana")
                c.choose("hana", r.interaction_id, 1)
            status = wait_for(lambda: (s := c.status())["finetune"]["versions_published"] and s)
        finally:
            stop.set()
            loop.join(60)
        assert status["finetune"]["pairs_trained"] == 3 and status["finetune"]["trainer"] == "engine"
        during = len(answers)
        answers.append(c.generate(**prompt).candidates[0].text)
    assert during >= 1 and set(answers) == {baseline}, (baseline, answers)
    code, _ = d.stop()
    assert code == 0


def test_lone_thumbs_and_ratings_train_and_publish_an_adapter(start_daemon) -> None:
    """Unpaired feedback (a thumb or a rating on one answer, no prompt asked twice) gives no pair,
    yet trains: staged KTO tasks in the engine, then a guarded version that names its examples."""
    d = start_daemon(extra_args=["--set", "finetune.pairs_per_version=3", "--set", "feedback.heldout_fraction=0.0"])
    with Client(d.endpoint, timeout_s=30) as c:
        c.consent("ivy")
        acks = []
        for i, text in enumerate(("Say hi", "Say bye", "Say thanks", "Say when")):
            r = c.generate(text, max_tokens=6, temperature=1.0, seed=i, user="ivy")
            if i == 0:
                acks.append(c.thumbs("ivy", r.interaction_id, up=True))
            elif i == 1:
                acks.append(c.thumbs("ivy", r.interaction_id, up=False))
            else:
                acks.append(c.rate("ivy", r.interaction_id, 5 if i == 2 else 3))  # 3 stars: neutral
        assert [len(a["pair_ids"]) for a in acks] == [0, 0, 0, 0]
        assert [len(a["unpaired_ids"]) for a in acks] == [1, 1, 1, 0]
        status = wait_for(lambda: (s := c.status())["finetune"]["versions_published"]
                          and s["adapters"]["versions_served"] and s)
        assert status["finetune"]["unpaired_trained"] == 3 and status["finetune"]["pairs_trained"] == 0
        assert status["feedback"]["unpaired_trained"] == 3
        assert [(a["version"], a["pairs"], a["unpaired"]) for a in c.adapters("ivy")] == [(1, 0, 3)]
        assert c.generate("Say hi", max_tokens=3, user="ivy").adapter == "ivy@1"
        receipt = c.forget("ivy")
        assert receipt["unpaired"] == 3 and receipt["adapter_versions"] == 1
    code, _ = d.stop()
    assert code == 0
