"use strict";
// klpipe inspect's page script. Every string from the file (ids, token text) is written with textContent,
// never as markup. A row's tokens are drawn when the row comes near the viewport, so a page of 50 rows of
// thousands of tokens opens at once.
(function () {
  const data = JSON.parse(document.getElementById("klpipe-data").textContent);
  const pieces = data.pieces; // [id, text, kind, bytes]: kind 0 plain, 1 special, 2 partial (text: its piece)
  const SPECIAL = 1, PARTIAL = 2;
  const tip = document.getElementById("tip");

  function bytes(b64) {
    const raw = atob(b64);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }
  function floats(b64, kind) {
    const view = new DataView(bytes(b64).buffer);
    const size = kind === "f8" ? 8 : 4;
    const out = new Float64Array(view.byteLength / size);
    for (let i = 0; i < out.length; i++) {
      out[i] = size === 8 ? view.getFloat64(i * 8, true) : view.getFloat32(i * 4, true);
    }
    return out;
  }
  // Indices into the token table: two bytes each, or four in a table of 65,536 entries or more.
  function uints(b64) {
    const view = new DataView(bytes(b64).buffer);
    if (data.index === "u2") {
      const out = new Uint16Array(view.byteLength / 2);
      for (let i = 0; i < out.length; i++) out[i] = view.getUint16(i * 2, true);
      return out;
    }
    const out = new Uint32Array(view.byteLength / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getUint32(i * 4, true);
    return out;
  }
  // The shortest decimal that reads back as the same float32 (numpy's repr): the file's value, exactly.
  function exact(value, kind) {
    if (Number.isNaN(value)) return "null";
    if (kind === "f8") return String(value);
    for (let p = 1; p < 10; p++) {
      const s = value.toPrecision(p);
      if (Math.fround(parseFloat(s)) === value) return String(parseFloat(s));
    }
    return String(value);
  }
  function fixed(value, digits) {
    return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
  }
  function visible(text) {
    return text.replace(/\r/g, "␍").replace(/\t/g, "⇥\t").replace(/\n/g, "↵\n");
  }
  function colour(gap, scale) {
    if (!Number.isFinite(gap)) return "";
    const a = Math.min(1, Math.abs(gap) / scale) * 0.85;
    return (gap >= 0 ? "rgba(var(--pos)," : "rgba(var(--neg),") + a.toFixed(3) + ")";
  }
  // The exact layers hold values ≥ 0: one hue each, from white at 0.
  function shade(value, scale, hue) {
    if (!Number.isFinite(value)) return "";
    return "rgba(var(" + hue + ")," + (Math.min(1, value / scale) * 0.85).toFixed(3) + ")";
  }
  // Each line of a row's tokens: how a token is coloured, and what the line says it shows.
  const LAYERS = {
    gap: { cls: "", colour: (v, k) => colour(v.policy[k] - v.ref[k], data.scale) },
    mismatch: { cls: "mismatch-tokens", colour: (v, k) => colour(v.policy[k] - v.sampler[k], data.mismatchScale) },
    exact: { cls: "exact-tokens", colour: (v, k) => shade(v.exact[k], data.exactScale, "--exact") },
    entropy: { cls: "entropy-tokens", colour: (v, k) => shade(v.entropy[k], data.entropyScale, "--entropy") },
  };
  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  document.getElementById("scale-label").textContent =
    "blue −" + data.scale.toFixed(2) + " … 0 … +" + data.scale.toFixed(2) + " red (the policy likes the token more " +
    "than the reference); colours saturate at the embedded tokens' 99th percentile";

  // -- the table -----------------------------------------------------------------------------------
  const rows = data.rows;
  const tbody = document.querySelector("#rows tbody");
  const heads = Array.from(document.querySelectorAll("#rows th"));
  const keys = heads.map((th) => th.dataset.key);
  const filter = document.getElementById("filter");
  let order = rows.slice();

  function cell(row, key) {
    const td = el("td", key === "id" ? "text" : "");
    const v = row[key];
    if (key === "id") {
      const a = el("a", "", v === null ? "(row " + row.index + ")" : String(v));
      a.href = "#row-" + row.rank;
      td.appendChild(a);
      td.title = row.name;
    } else if (key === "rank" || key === "tokens" || key === "masked") td.textContent = String(v);
    else if (key === "step") td.textContent = v === null ? "–" : String(v);
    else td.textContent = fixed(v, 4);
    td.dataset.key = key;
    return td;
  }
  function matches(row) {
    const q = filter.value.trim().toLowerCase();
    return !q || String(row.id === null ? "" : row.id).toLowerCase().includes(q);
  }
  function drawTable() {
    const body = document.createDocumentFragment();
    let shown = 0;
    for (const row of order) {
      if (!matches(row)) continue;
      shown++;
      const tr = el("tr", row.extreme ? "extreme" : "");
      tr.dataset.rank = row.rank;
      for (const key of keys) tr.appendChild(cell(row, key));
      body.appendChild(tr);
    }
    tbody.replaceChildren(body);
    document.getElementById("shown").textContent = shown + " of " + rows.length + " embedded rows shown";
    for (const row of rows) views.get(row.rank).hidden = !matches(row);
  }
  function compare(key, type, direction) {
    return (a, b) => {
      const x = a[key], y = b[key];
      if (x === null || y === null) return x === y ? 0 : x === null ? 1 : -1; // missing values last
      const c = type === "num" ? x - y : String(x).localeCompare(String(y), undefined, { numeric: true });
      return c * direction || a.rank - b.rank;
    };
  }
  heads.forEach((th) => {
    th.querySelector("button").addEventListener("click", () => {
      const direction = th.getAttribute("aria-sort") === "descending" ? 1 : -1;
      heads.forEach((h) => h.setAttribute("aria-sort", "none"));
      th.setAttribute("aria-sort", direction === 1 ? "ascending" : "descending");
      order = rows.slice().sort(compare(th.dataset.key, th.dataset.type, direction));
      drawTable();
    });
  });
  filter.addEventListener("input", drawTable);

  // -- the rows' tokens ----------------------------------------------------------------------------
  const container = document.getElementById("row-views");
  const views = new Map();

  // mode: a key of LAYERS ("gap", policy − ref, is the first line; each other on its own scale).
  function token(row, values, k, pieceIndex, prompt, mode) {
    const piece = pieces[pieceIndex];
    const span = el("span", "tok" + (piece[2] === SPECIAL ? " special" : piece[2] === PARTIAL ? " partial" : ""),
                    visible(piece[1]));
    span.tabIndex = -1;
    span.setAttribute("data-k", k);
    if (!prompt && (!values.mask || values.mask[k])) span.style.background = LAYERS[mode].colour(values, k);
    return span;
  }
  function drawResponse(row, target) {
    const mode = Object.keys(LAYERS).find((m) => LAYERS[m].cls && target.classList.contains(LAYERS[m].cls)) || "gap";
    const values = {
      pieces: uints(row.response), policy: floats(row.policy, row.float), ref: floats(row.ref, row.float),
      mask: row.mask === null ? null : bytes(row.mask),
      sampler: row.sampler === null ? null : floats(row.sampler, row.float),
      exact: row.exact === null ? null : floats(row.exact, row.float),
      entropy: row.entropy === null ? null : floats(row.entropy, row.float),
    };
    target.values = values;
    const out = document.createDocumentFragment();
    let group = null;
    for (let k = 0; k < values.pieces.length; k++) {
      const span = token(row, values, k, values.pieces[k], false, mode);
      if (values.mask && !values.mask[k]) {
        if (group === null) {
          let n = 0;
          while (k + n < values.mask.length && !values.mask[k + n]) n++;
          group = el("span", "masked");
          group.appendChild(el("span", "masked-label", "tool result · mask 0 · " + n + " token" +
                                                      (n === 1 ? "" : "s") + " · not scored"));
          out.appendChild(group);
        }
        group.appendChild(span);
      } else {
        group = null;
        out.appendChild(span);
      }
    }
    target.replaceChildren(out);
    target.style.minHeight = "";
    const first = target.querySelector(".tok");
    if (first) first.tabIndex = 0;
  }
  function drawPrompt(row, target) {
    const ids = uints(row.prompt);
    const out = document.createDocumentFragment();
    for (let k = 0; k < ids.length; k++) out.appendChild(token(row, null, k, ids[k], true, "gap"));
    target.replaceChildren(out);
    const first = target.querySelector(".tok");
    if (first) first.tabIndex = 0;
  }

  function figures(row) {
    const parts = [];
    if (row.step !== null) parts.push("step " + row.step);
    parts.push("KL " + fixed(row.kl, 4));
    if (row.penalty !== null) parts.push("penalty " + fixed(row.penalty, 4) + " (coeff " + fixed(row.coeff, 4) + ")");
    parts.push("reward " + fixed(row.reward, 4) + (row.adjusted !== null ? " → " + fixed(row.adjusted, 4) : ""));
    parts.push(row.tokens + " tokens scored" + (row.masked ? ", " + row.masked + " masked" : ""));
    parts.push("largest |gap| " + fixed(row.maxGap, 3));
    if (row.logPplDiff !== null && row.logPplDiff !== undefined) parts.push("log_ppl_diff " + fixed(row.logPplDiff, 5));
    if (row.exact !== null) parts.push("exact KL " + fixed(row.exactKl, 4) + " · entropy " + fixed(row.entropyMean, 4));
    return parts.join(" · ");
  }
  const pending = new Map();
  const observer = "IntersectionObserver" in window ? new IntersectionObserver((entries) => {
    for (const entry of entries) {
      if (!entry.isIntersecting) continue;
      observer.unobserve(entry.target);
      const row = pending.get(entry.target);
      pending.delete(entry.target);
      drawResponse(row, entry.target);
    }
  }, { rootMargin: "800px 0px" }) : null;

  for (const row of rows) {
    const view = el("article", "row-view" + (row.extreme ? " extreme" : ""));
    view.id = "row-" + row.rank;
    view.dataset.index = row.index;
    const h = el("h3");
    h.appendChild(document.createTextNode("#" + row.rank + " "));
    h.appendChild(el("span", "row-id", row.id === null ? "(row " + row.index + ")" : String(row.id)));
    if (row.extreme) {
      h.appendChild(document.createTextNode(" "));
      h.appendChild(el("span", "badge", "> " + data.extremeNats + " nats"));
    }
    view.appendChild(h);
    view.appendChild(el("p", "figures", figures(row)));
    if (row.prompt !== null) {
      const details = el("details", "prompt");
      const summary = el("summary", "", "prompt (" + row.promptTokens + " tokens)");
      const body = el("div", "tokens prompt-tokens");
      details.append(summary, body);
      details.addEventListener("toggle", () => { if (details.open && !body.firstChild) drawPrompt(row, body); });
      view.appendChild(details);
    }
    const response = el("div", "tokens response");
    // About the height the tokens will take (3 characters a token, 140 a line), so that only the rows
    // near the viewport are drawn, not every still-empty row at once.
    response.style.minHeight = Math.ceil((row.tokens + row.masked) * 3 / 140) * 22 + "px";
    response.setAttribute("aria-label", "response tokens of row " + (row.id === null ? row.index : row.id));
    view.appendChild(response);
    const lines = [response];
    if (row.sampler !== null) {
      view.appendChild(el("p", "mismatch-label", "trainer − sampler, ℓ (nats): blue −" + data.mismatchScale.toPrecision(2) +
                                                 " … +" + data.mismatchScale.toPrecision(2) + " red"));
      const mismatch = el("div", "tokens response mismatch-tokens");
      mismatch.style.minHeight = response.style.minHeight;
      mismatch.setAttribute("aria-label", "trainer against sampler, tokens of row " + (row.id === null ? row.index : row.id));
      view.appendChild(mismatch);
      lines.push(mismatch);
    }
    if (row.exact !== null) {
      for (const [mode, label, key] of [["exact", "exact KL(π‖π_ref) over the vocabulary (nats): white 0 … ", "exactScale"],
                                        ["entropy", "policy entropy H(π) (nats): white 0 … ", "entropyScale"]]) {
        view.appendChild(el("p", "layer-label " + mode + "-label", label + data[key].toPrecision(2)));
        const layer = el("div", "tokens response " + LAYERS[mode].cls);
        layer.style.minHeight = response.style.minHeight;
        layer.setAttribute("aria-label", mode + " tokens of row " + (row.id === null ? row.index : row.id));
        view.appendChild(layer);
        lines.push(layer);
      }
    }
    container.appendChild(view);
    views.set(row.rank, view);
    for (const line of lines) {
      if (observer) { pending.set(line, row); observer.observe(line); } else drawResponse(row, line);
    }
  }

  // -- hover and focus -----------------------------------------------------------------------------
  function line(name, value) {
    const div = el("div");
    div.appendChild(el("b", "", name.padEnd(8)));
    const v = el("span", "", value);
    v.dataset.field = name;
    div.appendChild(v);
    return div;
  }
  function show(span) {
    const tokens = span.closest(".tokens");
    const view = span.closest(".row-view");
    const row = rows.find((r) => "row-" + r.rank === view.id);
    const k = Number(span.dataset.k);
    const prompt = tokens.classList.contains("prompt-tokens");
    const ids = prompt ? uints(row.prompt) : tokens.values.pieces;
    const piece = pieces[ids[k]];
    const out = [line("token", (prompt ? "prompt " : "response ") + k + " of " + ids.length), line("id", String(piece[0])),
                 line("text", piece[2] === PARTIAL ? "(part of a character the next token completes)" :
                                                     JSON.stringify(piece[1]))];
    if (piece[2] === PARTIAL) out.push(line("piece", piece[1] + (piece[3] ? " (bytes " + piece[3] + ")" : "")));
    if (piece[2] === SPECIAL) out.push(line("kind", "special token"));
    if (!prompt) {
      const v = tokens.values;
      out.push(line("policy", exact(v.policy[k], row.float)), line("ref", exact(v.ref[k], row.float)));
      if (v.sampler) out.push(line("sampler", exact(v.sampler[k], row.float)));
      if (v.mask && !v.mask[k]) out.push(line("mask", "0: not sampled by the policy (a tool's result); not scored"));
      else {
        out.push(line("gap", (v.policy[k] - v.ref[k] >= 0 ? "+" : "") + (v.policy[k] - v.ref[k]).toFixed(4)));
        if (v.sampler) {
          const ratio = v.policy[k] - v.sampler[k];
          out.push(line("ℓ", (ratio >= 0 ? "+" : "") + ratio.toPrecision(4)));
        }
        if (v.exact) out.push(line("exact", exact(v.exact[k], row.float)), line("entropy", exact(v.entropy[k], row.float)));
      }
    }
    tip.replaceChildren(...out);
    tip.hidden = false;
    const box = span.getBoundingClientRect();
    tip.style.left = Math.max(4, Math.min(window.scrollX + box.left, window.scrollX + document.documentElement.clientWidth
                                          - tip.offsetWidth - 4)) + "px";
    tip.style.top = (window.scrollY + box.bottom + 4) + "px";
    document.querySelectorAll(".tok.active").forEach((t) => t.classList.remove("active"));
    span.classList.add("active");
  }
  container.addEventListener("mouseover", (e) => { const t = e.target.closest(".tok"); if (t) show(t); });
  container.addEventListener("mouseleave", () => { tip.hidden = true; });
  container.addEventListener("focusin", (e) => { const t = e.target.closest(".tok"); if (t) show(t); });
  container.addEventListener("focusout", () => { tip.hidden = true; });
  // Arrow keys move between a sequence's tokens (one Tab stop per sequence, not one per token).
  container.addEventListener("keydown", (e) => {
    const t = e.target.closest(".tok");
    if (!t) return;
    const all = Array.from(t.closest(".tokens").querySelectorAll(".tok"));
    const i = all.indexOf(t);
    const j = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: all.length - 1 }[e.key];
    if (j === undefined || j < 0 || j >= all.length) return;
    e.preventDefault();
    t.tabIndex = -1;
    all[j].tabIndex = 0;
    all[j].focus();
  });

  drawTable();
})();
