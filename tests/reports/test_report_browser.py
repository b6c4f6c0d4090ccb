"""The report of a real tiny run, opened in headless Chromium: it loads without a console error,
shows every dumped episode, a click on a step lists the other steps of its cell, each with its
GAE terms (the run is GAGPO's), the filters work, and env text holding markup never runs as code.

Needs Debian's chromium (`apt-get update && apt-get install -y chromium`) and playwright from PyPI
(the `dev` extra) driving it; `playwright install` (a download) is never needed. Without
/usr/bin/chromium these tests skip and say so.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
from peft import LoraConfig

from bipace_trainer import BiPACETrainer
from bipace_trainer.reports.report import write_report

from tests.trainer.tiny_setup import LORA, tiny_args

CHROMIUM = os.environ.get("BIPACE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip

needs_chromium = pytest.mark.skipif(
    not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)),
    reason=f"no Chromium at {CHROMIUM}: install Debian's chromium (apt-get update && apt-get install -y chromium), "
    "or set BIPACE_CHROMIUM to a Chromium binary",
)


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


def open_page(browser, path: Path):
    """The page at `path`, with every console error and uncaught exception collected in `page.errors`."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.errors = []
    page.on("console", lambda message: page.errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("request", lambda request: page.errors.append(f"network request: {request.url}")
            if not request.url.startswith(("file:", "data:", "blob:", "about:")) else None)  # fmt: skip
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    return page


def shared_cells(dump: Path) -> dict[tuple[int, int], list[str]]:
    """{(rank, cell): [row ids]} of a training dump's steps, computed from the file (the page's ids)."""
    cells = defaultdict(list)
    for line in dump.read_text().splitlines():
        episode = json.loads(line)
        for turn in episode["turns"]:
            cells[(episode["rank"], turn["cluster"])].append(f"e0-{episode['rank']}-{episode['episode']}-t{turn['turn']}")
    return cells


def gae_terms(dump: Path) -> dict[str, dict]:
    """{row id: the step's `gae` terms} of a training dump (the page's ids)."""
    terms = {}
    for line in dump.read_text().splitlines():
        episode = json.loads(line)
        for turn in episode["turns"]:
            terms[f"e0-{episode['rank']}-{episode['episode']}-t{turn['turn']}"] = turn["gae"]
    return terms


@pytest.mark.slow
@needs_chromium
def test_the_report_of_a_tiny_run_works_in_a_browser(warm_policy, browser, tmp_path):
    model, tokenizer = warm_policy
    run = tmp_path / "run"
    # gagpo: hash cells (anchors repeat in the tiny env), and GAE terms on every training step
    args = tiny_args(run, preset="gagpo", max_steps=2, rollout_dump_steps=1)
    trainer = BiPACETrainer(model, args=args, processing_class=tokenizer, peft_config=LoraConfig(**LORA))
    try:
        trainer.train()
    finally:
        trainer.close_envs()
    trainer.save_state()
    path = write_report(run, report_key=trainer.collector.source.report_key)
    dumps = sorted((run / "rollouts").glob("*.jsonl"))
    expected = sum(len(p.read_text().splitlines()) for p in dumps)
    per_step = args.tasks_per_iteration * args.num_generations
    assert len(dumps) == 4 and expected == 2 * per_step + 2 * trainer.eval_history[-1]["num_tasks"]

    page = open_page(browser, path)
    if os.environ.get("BIPACE_REPORT_KEEP"):  # a page to look at when this test fails
        shutil.copytree(run, os.environ["BIPACE_REPORT_KEEP"], dirs_exist_ok=True)
    assert page.locator("details.episode").count() == expected
    assert page.locator("#shown-count").inner_text() == f"{expected} of {expected} episodes shown"
    assert page.locator(".js-plotly-plot").count() == 3  # rates, loss, diagnostics drawn by the inlined plotly
    assert page.locator(".js-plotly-plot .main-svg").count() >= 3

    # the first training dump (data-dump 0): a step whose cell holds other steps
    cells = shared_cells(run / "rollouts" / "step-000001.jsonl")
    members = max(cells.values(), key=len)
    assert len(members) >= 2, "the tiny env's anchors repeat within a task group"
    row_id = members[0]
    page.locator(f"#{row_id}").evaluate("row => row.closest('details').querySelector('summary').click()")
    page.locator(f"#{row_id}").click()
    peers = page.locator("tr.peers li.peer-item")
    assert peers.count() == len(members) - 1
    labels = [page.locator(f"#{other}").get_attribute("data-label") for other in members[1:]]
    assert sorted(peers.locator("a").all_inner_texts()) == sorted(labels)
    assert sorted(page.locator("tr.step.peer").evaluate_all("rows => rows.map(r => r.id)")) == sorted(members[1:])
    # the clicked step shows its GAE terms as the dump holds them, and so does each peer in the list
    dumped = gae_terms(run / "rollouts" / "step-000001.jsonl")[row_id]
    terms = page.locator(f"#{row_id} div.gae").inner_text()
    assert terms.startswith(f"GAE: V̄ {dumped['value']:.3f}, next V̄ {dumped['next_value']:.3f}, δ {dumped['delta']:+.3f}")
    assert f"Σ(γλ)ᵏδ {dumped['discounted_sum']:+.3f}" in terms
    assert all("GAE: V̄" in item for item in peers.all_inner_texts())
    # a peer's link opens its episode
    last = members[-1]
    peers.locator("a", has_text=page.locator(f"#{last}").get_attribute("data-label")).first.click()
    assert page.locator(f"#{last}").evaluate("row => row.closest('details').open")
    # a second click on the step closes the list
    page.locator(f"#{row_id}").click()
    assert page.locator("tr.peers").count() == 0

    # filters: won episodes only, then one dump only
    won = sum(json.loads(line)["won"] for p in dumps for line in p.read_text().splitlines())
    page.select_option("#filter-outcome", "won")
    assert page.locator("#shown-count").inner_text() == f"{won} of {expected} episodes shown"
    page.select_option("#filter-outcome", "")
    page.select_option("#filter-dump", "0")
    first_dump = (run / "rollouts" / "step-000001.jsonl").read_text().splitlines()
    assert page.locator("details.episode:visible").count() == len(first_dump)
    assert page.errors == []
    page.close()


@pytest.mark.slow
@needs_chromium
def test_markup_in_env_text_never_runs(browser, tmp_path):
    hostile = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>\x1b[0m'
    turn = {"turn": 0, "observation": hostile, "reply": hostile, "action": hostile, "valid": True, "reward": 0.0,
            "return": 0.0, "advantage": 0.5, "cluster": 1, "branch": "loo", "done": True,
            "levels": [{"k": 0, "cell": 1, "size": 2, "advantage": 0.5, "used": True},
                       {"k": 1, "advantage": hostile}]}  # fmt: skip
    episode = {"episode": 0, "rank": 0, "task_id": 1, "task": hostile, "attributes": {"kind": hostile}, "won": False,
               "turns_taken": 1, "invalid_steps": 0, "reward": 0.0, "turns": [turn, dict(turn, turn=1)]}  # fmt: skip
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step-000001.jsonl").write_text(json.dumps(episode) + "\n")
    page = open_page(browser, write_report(tmp_path))
    page.locator("details.episode summary").click()
    page.locator("#e0-0-0-t0").click()  # the peers list copies text from the row
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0
    assert hostile.replace("\x1b", "\\x1b") in page.locator("#e0-0-0-t0 pre.obs").inner_text()
    assert page.locator("tr.peers li.peer-item").count() == 1
    # the peer's credit column, block by block (branch; HGPO levels, one per level), markup as text
    shown = hostile.replace("\x1b", "\\x1b")
    assert page.locator("tr.peers li.peer-item").inner_text().endswith(
        f", A +0.500, branch loo; HGPO levels: k0: cell 1, n 2, a +0.500, used; k1: cell –, n –, a {shown}, –"
    )
    assert page.errors == []
    page.close()


@pytest.mark.slow
@needs_chromium
def test_the_toolbar_covers_no_panel_title(browser, tmp_path):
    log = [{"step": s, "episode/success_rate": 0.5, "loss": 0.1, "estimator/cluster_eps": 0.00066,
            "estimator/singleton_rate": 0.1 * s, "advantage/std": 1.0 / s, "advantage/mean": 0.0} for s in (1, 2, 3)]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": log}))
    page = open_page(browser, write_report(tmp_path))
    grid = page.locator(".figure").filter(has_text="Estimator diagnostics").locator(".js-plotly-plot")
    grid.hover()  # plotly shows its toolbar while the pointer is over the figure
    bar = grid.locator(".modebar").bounding_box()
    assert bar is not None and bar["width"] > 0
    titles = grid.locator("g.annotation")
    assert titles.count() == 4
    for i in range(titles.count()):
        box = titles.nth(i).bounding_box()
        apart = (box["x"] + box["width"] <= bar["x"] or bar["x"] + bar["width"] <= box["x"]
                 or box["y"] + box["height"] <= bar["y"] or bar["y"] + bar["height"] <= box["y"])
        assert apart, (titles.nth(i).inner_text(), box, bar)
    assert page.errors == []
    page.close()
