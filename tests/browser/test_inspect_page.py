"""`klpipe inspect`'s page in a real headless Chromium, held to the file it was made from.

Every page is opened from a file: URL, and every test ends by checking (conftest.open_page) that the page
requested nothing but itself and raised no script error.
"""

import io
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

from klpipe.cache import METADATA_KEY
from tests.browser.conftest import TINY_GEMMA
from tests.helpers import provenance, run_cli

MASKED_GREY = "rgb(228, 228, 228)"  # page.css: --masked


def column(page, key: str) -> list[str]:
    return page.locator(f"#rows tbody td[data-key='{key}']").all_inner_texts()


def draw(page, rank: int):
    """Scroll row `rank`'s tokens into view, where the page draws them."""
    page.locator(f"#row-{rank}").scroll_into_view_if_needed()
    page.wait_for_selector(f"#row-{rank} .response .tok")
    return int(page.get_attribute(f"#row-{rank}", "data-index"))


def tip(page, field: str) -> str:
    return page.text_content(f"#tip [data-field='{field}']")


def file_rows(scored) -> list[dict]:
    return pq.read_table(scored).to_pylist()


def test_the_top_row_has_the_largest_kl(tool_calls, open_page):
    scored, path = tool_calls
    page = open_page(path).page
    rows = file_rows(scored)
    largest = max(rows, key=lambda r: r["kl"])
    assert page.inner_text("#rows tbody tr:first-child td[data-key='id']") == largest["id"]
    assert column(page, "kl")[0] == f"{largest['kl']:.4f}"
    assert len(column(page, "kl")) == len(rows)  # 32 rows: all embedded under --top 50
    assert "This page embeds 32 of the 32 rows in the file" in page.inner_text("header")


def test_hovering_a_token_shows_the_files_logprobs(tool_calls, open_page):
    scored, path = tool_calls
    page = open_page(path).page
    index = draw(page, 1)
    row = file_rows(scored)[index]
    ids, policy, ref, mask = row["completion_ids"], row["policy_logprobs"], row["ref_logprobs"], row["tool_mask"]
    scored_k = [k for k, m in enumerate(mask) if m]
    masked_k = [k for k, m in enumerate(mask) if not m]
    for k in [scored_k[0], scored_k[1], scored_k[len(scored_k) // 2], scored_k[-1], masked_k[0]]:
        page.hover(f"#row-1 .response .tok[data-k='{k}']")
        assert tip(page, "token") == f"response {k} of {len(ids)}"
        assert int(tip(page, "id")) == ids[k]
        # The tooltip's digits read back as the file's float32, exactly.
        assert np.float32(float(tip(page, "policy"))) == np.float32(policy[k])
        if mask[k]:
            assert np.float32(float(tip(page, "ref"))) == np.float32(ref[k])
            assert abs(float(tip(page, "gap")) - (policy[k] - ref[k])) <= 5e-5
        else:
            assert ref[k] is None and tip(page, "ref") == "null"
            assert tip(page, "mask").startswith("0: not sampled by the policy")


def test_mask_zero_spans_are_greyed_and_labelled(tool_calls, open_page):
    scored, path = tool_calls
    page = open_page(path).page
    index = draw(page, 1)
    mask = file_rows(scored)[index]["tool_mask"]
    masked = page.locator("#row-1 .response .masked .tok")
    assert masked.count() == mask.count(0) > 0
    backgrounds = masked.evaluate_all("spans => spans.map(s => getComputedStyle(s).backgroundColor)")
    assert set(backgrounds) == {MASKED_GREY}
    outside = page.locator("#row-1 .response > .tok").evaluate_all(
        "spans => spans.map(s => getComputedStyle(s).backgroundColor)")
    assert len(outside) == mask.count(1) and MASKED_GREY not in outside
    spans = []  # the runs of 0s in the file, each one labelled group
    for k, m in enumerate(mask):
        if not m and (k == 0 or mask[k - 1]):
            spans.append(0)
        if not m:
            spans[-1] += 1
    labels = page.locator("#row-1 .masked-label").all_inner_texts()
    assert labels == [f"tool result · mask 0 · {n} tokens · not scored" for n in spans]


def test_sorting_and_filtering(tool_calls, open_page):
    scored, path = tool_calls
    page = open_page(path).page
    rewards = [r["reward"] for r in file_rows(scored)]
    page.click("th[data-key='reward'] button")
    assert column(page, "reward") == [f"{v:.4f}" for v in sorted(rewards, reverse=True)]
    assert page.get_attribute("th[data-key='reward']", "aria-sort") == "descending"
    page.click("th[data-key='reward'] button")
    assert column(page, "reward") == [f"{v:.4f}" for v in sorted(rewards)]
    page.click("th[data-key='id'] button")
    ids = [r["id"] for r in file_rows(scored)]
    assert column(page, "id") == sorted(ids, reverse=True)

    page.fill("#filter", "tool2")
    wanted = sorted(i for i in ids if "tool2" in i)
    assert sorted(column(page, "id")) == wanted and len(wanted) == 8
    assert page.inner_text("#shown") == "8 of 32 embedded rows shown"
    assert sorted(page.locator(".row-view:not([hidden]) .row-id").all_inner_texts()) == wanted
    page.fill("#filter", "")
    assert len(column(page, "id")) == 32


def test_the_keyboard_reaches_every_token(tool_calls, open_page):
    _, path = tool_calls
    page = open_page(path).page
    draw(page, 1)
    page.focus("#row-1 .response .tok[data-k='0']")
    assert tip(page, "token").startswith("response 0 of ")
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowRight")
    assert page.evaluate("document.activeElement.dataset.k") == "2"
    assert tip(page, "token").startswith("response 2 of ")
    # One Tab stop per response: the focused token is the only one Tab would land on.
    assert page.locator("#row-1 .response .tok[tabindex='0']").count() == 1


def test_the_prompt_is_collapsed_and_decodes_faithfully(tool_calls, open_page):
    scored, path = tool_calls
    page = open_page(path).page
    index = draw(page, 1)
    assert page.locator("#row-1 details.prompt").get_attribute("open") is None
    assert page.locator("#row-1 .prompt-tokens .tok").count() == 0
    page.click("#row-1 details.prompt > summary")
    prompt_ids = file_rows(scored)[index]["prompt_ids"]
    spans = page.locator("#row-1 .prompt-tokens .tok")
    assert spans.count() == len(prompt_ids)
    shown = "".join(spans.all_text_contents())
    tokenizer = Tokenizer.from_file(str(TINY_GEMMA / "tokenizer.json"))
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    # Newlines are visible (↵) and kept; the whole decodes to the tokenizer's own text.
    assert "↵\n" in shown and shown.replace("↵\n", "\n").replace("⇥\t", "\t") == text


def test_a_screenshot_shows_the_page(tool_calls, open_page, tmp_path):
    from PIL import Image

    _, path = tool_calls
    page = open_page(path).page
    draw(page, 1)
    png = page.screenshot(full_page=True)
    image = Image.open(io.BytesIO(png)).convert("RGB")
    assert image.width == 1280 and image.height > 2000
    colours = image.getcolors(maxcolors=1 << 20)
    assert len(colours) > 100  # text, charts, token colours: not a blank page
    assert max(count for count, _ in colours) < 0.95 * image.width * image.height


def test_text_from_the_file_stays_text_in_the_browser(tmp_path, open_page):
    tokenizer = Tokenizer.from_file(str(TINY_GEMMA / "tokenizer.json"))
    hostile = "<img src=x onerror=window.__xss=1><script>window.__xss=2</script>"
    response = tokenizer.encode(hostile, add_special_tokens=False).ids
    schema = pa.schema([("id", pa.string()), ("response_ids", pa.list_(pa.int32())),
                        ("policy_logprobs", pa.list_(pa.float32())), ("ref_logprobs", pa.list_(pa.float32())),
                        ("reward", pa.float64())])
    table = pa.Table.from_pylist([{"id": hostile, "response_ids": response, "policy_logprobs": [-1.0] * len(response),
                                   "ref_logprobs": [-2.0] * len(response), "reward": 1.0}], schema=schema)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: provenance(model=str(TINY_GEMMA)).to_json()}),
                   tmp_path / "hostile.parquet")
    result = run_cli("inspect", str(tmp_path / "hostile.parquet"), "-o", str(tmp_path / "kl.html"))
    assert result.returncode == 0, result.stderr
    page = open_page(tmp_path / "kl.html").page
    draw(page, 1)
    assert page.evaluate("window.__xss") is None
    assert page.locator("img").count() == 0 and page.locator("script").count() == 2
    assert page.inner_text("#rows tbody td[data-key='id']") == hostile
    assert "".join(page.locator("#row-1 .response .tok").all_text_contents()) == hostile


def big_cache(path, rows=50, tokens=4096, seed=0):
    """`rows` rows of `tokens` response tokens: random ids of the sample vocabulary, float32 logprobs."""
    rng = np.random.default_rng(seed)
    schema = pa.schema([("id", pa.string()), ("step", pa.int64()), ("prompt_ids", pa.list_(pa.int32())),
                        ("response_ids", pa.list_(pa.int32())), ("policy_logprobs", pa.list_(pa.float32())),
                        ("ref_logprobs", pa.list_(pa.float32())), ("reward", pa.float64())])
    policy = -rng.exponential(1.0, (rows, tokens)).astype(np.float32)
    ref = (policy - rng.normal(0.2, 0.6, (rows, tokens))).astype(np.float32)
    table = pa.Table.from_pydict({
        "id": [f"r{i}" for i in range(rows)], "step": [i // 10 for i in range(rows)],
        "prompt_ids": [rng.integers(4, 512, 256).tolist() for _ in range(rows)],
        "response_ids": [rng.integers(4, 512, tokens).tolist() for _ in range(rows)],
        "policy_logprobs": list(policy), "ref_logprobs": list(ref), "reward": rng.normal(size=rows).tolist(),
    }, schema=schema)
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: provenance(model=str(TINY_GEMMA)).to_json()}), path)
    return path


def test_a_page_of_50_rows_of_4096_tokens_is_small_and_opens_fast(tmp_path, open_page):
    cache = big_cache(tmp_path / "big.parquet")
    scored = tmp_path / "big.scored.parquet"
    assert run_cli("score", str(cache), "-o", str(scored)).returncode == 0
    started = time.perf_counter()
    result = run_cli("inspect", str(scored), "-o", str(tmp_path / "kl.html"))
    inspect_seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    size = (tmp_path / "kl.html").stat().st_size
    opened = open_page(tmp_path / "kl.html")
    page = opened.page
    # Timed inside the page: from scrolling to the first row to the frame after its tokens are drawn.
    drawn, painted = page.evaluate("""() => new Promise(done => {
        const start = performance.now();
        document.getElementById("row-1").scrollIntoView();
        const check = () => {
            if (!document.querySelector("#row-1 .response .tok")) return requestAnimationFrame(check);
            const drawn = performance.now() - start;
            requestAnimationFrame(() => done([drawn, performance.now() - start]));
        };
        check();
    })""")
    assert page.locator("#row-1 .response .tok").count() == 4096
    assert page.locator(".response .tok").count() < 4 * 4096  # only the rows near the viewport are drawn
    navigation = page.evaluate("performance.getEntriesByType('navigation')[0].toJSON()")
    print(f"\n50 rows x 4,096 tokens: page {size / 2**20:.2f} MiB, written in {inspect_seconds:.1f} s "
          f"(klpipe inspect, a fresh process); load event {navigation['loadEventEnd']:.0f} ms after navigation "
          f"started; the first row's 4,096 tokens drawn {drawn:.0f} ms and painted {painted:.0f} ms after "
          "scrolling to them")
    assert size < 6 * 2**20
    assert navigation["loadEventEnd"] < 5000 and painted < 3000


def test_the_exact_kl_and_entropy_layers_colour_each_token_by_the_files_values(tool_calls, tmp_path, open_page):
    """The tool-calling sample with the exact KL's columns added as precompute --policy writes them (values ≥ 0,
    null where the mask is 0), scored with --estimator full: each row carries two more lines of its tokens."""
    from klpipe.cache import FULL_KL_COLUMNS, Provenance

    scored, _ = tool_calls
    table = pq.read_table(scored).drop_columns(["kl", "kl_coeff", "kl_penalty", "adjusted_reward"])
    rng = np.random.default_rng(7)
    masks = table.column("tool_mask").to_pylist()
    for name in FULL_KL_COLUMNS:
        values = [[float(np.float32(rng.gamma(1.0, 0.5))) if m else None for m in mask] for mask in masks]
        table = table.append_column(name, pa.array(values, pa.list_(pa.float32())))
    made = Provenance.from_json(table.schema.metadata[METADATA_KEY])
    made.full_kl = True
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: made.to_json()}), tmp_path / "exact.parquet")
    for args in (["score", str(tmp_path / "exact.parquet"), "-o", str(tmp_path / "exact.scored.parquet"),
                  "--estimator", "full"],
                 ["inspect", str(tmp_path / "exact.scored.parquet"), "-o", str(tmp_path / "kl.html")]):
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr
    opened = open_page(tmp_path / "kl.html")
    page = opened.page
    index = draw(page, 1)
    page.wait_for_selector("#row-1 .entropy-tokens .tok")
    row = pq.read_table(tmp_path / "exact.scored.parquet").to_pylist()[index]
    mask = row["tool_mask"]
    scales = page.evaluate("JSON.parse(document.getElementById('klpipe-data').textContent)")
    for layer, name, scale, hue in (("exact", "kl_policy_ref", scales["exactScale"], (123, 97, 168)),
                                    ("entropy", "policy_entropy", scales["entropyScale"], (34, 139, 96))):
        colours = page.locator(f"#row-1 .{layer}-tokens .tok").evaluate_all(
            "spans => spans.map(s => getComputedStyle(s).backgroundColor)")
        assert len(colours) == len(mask)
        for k, m in enumerate(mask):
            if not m:
                assert colours[k] == MASKED_GREY
                continue
            alpha = min(1.0, row[name][k] / scale) * 0.85
            found = [float(x) for x in colours[k][colours[k].index("(") + 1:-1].split(",")]
            # Chromium keeps alpha in 8 bits and prints it to 2 decimals: within 1/255 + 0.005 of the value.
            assert tuple(found[:3]) == hue and abs(found[3] - alpha) <= 1 / 255 + 0.005, (k, colours[k])
        assert 0.1 < scale < 10 and page.inner_text(f"#row-1 .{layer}-label").endswith(f"{scale:.2g}")
    k = mask.index(1)
    page.hover(f"#row-1 .exact-tokens .tok[data-k='{k}']")
    assert np.float32(float(tip(page, "exact"))) == np.float32(row["kl_policy_ref"][k])
    assert np.float32(float(tip(page, "entropy"))) == np.float32(row["policy_entropy"][k])
    assert "exact KL" in page.inner_text("#row-1 .figures")
    assert column(page, "exactKl")[0] == column(page, "kl")[0]  # scored with full: the row's KL is its exact KL
