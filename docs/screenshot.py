"""Remake docs/inspect.png from `make demo`'s build/demo/kl.html: the header and first curves, then the top row
with a token hovered. Needs Playwright and Debian's chromium, as `make test-browser` installs them:

    make demo test-browser && .venv/bin/python docs/screenshot.py
"""

import io
import shutil
from pathlib import Path

from PIL import Image
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 1100

with sync_playwright() as playwright:
    browser = playwright.chromium.launch(executable_path=shutil.which("chromium"))
    page = browser.new_page(viewport={"width": WIDTH, "height": 900})
    page.goto((ROOT / "build" / "demo" / "kl.html").as_uri())
    top = Image.open(io.BytesIO(page.screenshot(clip={"x": 0, "y": 0, "width": WIDTH, "height": 452})))
    page.locator("#row-1").scroll_into_view_if_needed()
    page.wait_for_selector("#row-1 .response .tok")
    page.hover("#row-1 .response .tok[data-k='20']")
    box = page.evaluate("(r => [r.top + window.scrollY, r.height])(document.getElementById('row-1')"
                        ".getBoundingClientRect())")
    row = Image.open(io.BytesIO(page.screenshot(full_page=True, clip={"x": 0, "y": box[0] - 8, "width": WIDTH,
                                                                        "height": box[1] + 110})))
    browser.close()
out = Image.new("RGB", (WIDTH, top.height + row.height), "white")
out.paste(top, (0, 0))
out.paste(row, (0, top.height))
out.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(ROOT / "docs" / "inspect.png", optimize=True)
