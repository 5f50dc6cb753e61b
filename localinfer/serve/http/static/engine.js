// The engine view: polls /v1/engine/state (the engine thread's last snapshot, with the /metrics samples of
// that moment) and draws the KV block pool, each step's batch, the step model against measured step times,
// rolling TTFT / ITL / tok/s, the requests running and queued, and what finished or was refused.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const POLL_MS = 500, WINDOW_S = 5, HISTORY = 240, GRID_PX = 260;
  const FREE = -1, CACHED = -2, PARKED = -3, SHARED = -4;
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#17becf", "#bcbd22", "#e377c2", "#8c564b",
                   "#3949ab", "#00897b", "#f4511e", "#6d4c41"];
  const COLOR = { free: "#d5d9de", cached: "#9fb3c8", parked: "#c9a27e", shared: "#7e57c2",
                  prefill: "#ff7f0e", decode: "#1f77b4", measured: "#1f77b4", predicted: "#d62728" };
  const engine = (LI.engine = { last: null, history: [], paused: false, polls: 0 });

  function metric(m, name) { return m && m[name] !== undefined ? m[name] : null; }
  function sumLabelled(m, prefix) {
    const out = {};
    for (const k in m) if (k.startsWith(prefix + "{")) out[k.slice(k.indexOf('"') + 1, k.lastIndexOf('"'))] = m[k];
    return out;
  }
  // A canvas drawn at the device's pixel ratio, its CSS height fixed (its height attribute, or cssHeight).
  function canvas(id, cssHeight) {
    const c = $(id), dpr = window.devicePixelRatio || 1;
    if (!c.dataset.h) c.dataset.h = c.getAttribute("height");
    const w = c.clientWidth || 300, h = cssHeight || Number(c.dataset.h);
    c.style.height = h + "px";
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = getComputedStyle(document.body).color;
    return { g, w, h };
  }
  function stat(parent, id, label, value) {
    const s = LI.el("div", "stat");
    const b = LI.el("b", null, value);
    b.id = id;
    s.appendChild(b);
    s.appendChild(LI.el("span", null, label));
    parent.appendChild(s);
  }

  // ---- rolling figures from consecutive snapshots ------------------------------
  function rolling(hist) {
    const out = [];
    for (let i = 1; i < hist.length; i++) {
      const b = hist[i];
      let j = i - 1;
      while (j > 0 && b.t - hist[j].t < WINDOW_S) j--;
      const a = hist[j], dt = b.t - a.t;
      if (dt <= 0) continue;
      const d = (name) => (metric(b.m, name) || 0) - (metric(a.m, name) || 0);
      const ttftN = d("localinfer_time_to_first_token_seconds_count");
      const itlN = d("localinfer_inter_token_latency_seconds_count");
      out.push({ t: b.t, ttft: ttftN > 0 ? d("localinfer_time_to_first_token_seconds_sum") / ttftN : null,
                 itl: itlN > 0 ? d("localinfer_inter_token_latency_seconds_sum") / itlN : null,
                 tps: (b.out - a.out) / dt });
    }
    return out;
  }

  // ---- drawing -----------------------------------------------------------------
  function drawStats(s, snap) {
    const m = snap.metrics, box = $("stats");
    box.replaceChildren();
    const prompt = metric(m, "localinfer_prompt_tokens_total") || 0;
    const hit = metric(m, "localinfer_prefix_cache_hit_tokens_total") || 0;
    const roll = rolling(engine.history);
    const last = (key) => { for (let i = roll.length - 1; i >= 0; i--) if (roll[i][key] !== null) return roll[i][key]; return null; };
    stat(box, "s-state", "state", s.state);
    stat(box, "s-running", "running", metric(m, "localinfer_requests_running"));
    stat(box, "s-waiting", "queued", metric(m, "localinfer_requests_waiting"));
    stat(box, "s-used", "KV blocks in use", metric(m, "localinfer_kv_blocks_used"));
    stat(box, "s-parked", "parked requests", metric(m, "localinfer_kv_sequences_parked"));
    if (snap.snapshots) {     // a hybrid or recurrent model: its state saved for prefix hits
      stat(box, "s-snapshots", "state snapshots (host MiB)",
           snap.snapshots.count + " (" + LI.fmt(snap.snapshots.bytes / 1048576, 1) + ")");
    }
    stat(box, "s-steps", "steps", metric(m, "localinfer_engine_steps_total"));
    stat(box, "s-admissions", "admissions", snap.counts.admissions);
    stat(box, "s-preemptions", "preemptions", metric(m, "localinfer_preemptions_total"));
    stat(box, "s-hit", "prefix-cache hit rate", prompt ? LI.fmt(100 * hit / prompt, 1) + "%" : "–");
    const itl = last("itl");
    stat(box, "s-ttft", "TTFT s (last 5 s with finishes)", LI.fmt(last("ttft"), 3));
    stat(box, "s-itl", "ITL ms (idem)", itl === null ? "–" : LI.fmt(1000 * itl, 1));
    stat(box, "s-tps", "output tok/s (5 s)", LI.fmt(last("tps"), 1));
  }

  function drawGrid(snap) {
    const pool = snap.pool, grid = pool.grid, n = grid.length;
    const counts = { free: 0, cached: 0, parked: 0, shared: 0, held: 0 };
    const per = {};
    for (const v of grid) {
      if (v === FREE) counts.free++;
      else if (v === CACHED) counts.cached++;
      else if (v === PARKED) counts.parked++;
      else if (v === SHARED) counts.shared++;
      else { counts.held++; per[v] = (per[v] || 0) + 1; }
    }
    engine.gridCounts = counts;
    const legend = $("legend");
    legend.replaceChildren();
    const item = (color, text, id) => {
      const span = LI.el("span");
      const sw = LI.el("i");
      sw.style.background = color;
      span.appendChild(sw);
      const t = LI.el("span", null, text);
      if (id) t.id = id;
      span.appendChild(t);
      legend.appendChild(span);
    };
    item(COLOR.free, "free " + counts.free, "g-free");
    item(PALETTE[0], "in use by one request " + counts.held, "g-held");
    item(COLOR.shared, "shared prefix " + counts.shared, "g-shared");
    item(COLOR.parked, "parked " + counts.parked, "g-parked");
    item(COLOR.cached, "cached " + counts.cached, "g-cached");
    $("pool-note").textContent = n + " blocks of " + snap.config.block_tokens + " tokens; " + pool.capacity +
      " can be in use at once" + (n > pool.capacity ? " (the rest cache parked KV in host memory)" : "");
    // cells as large as fit the width in at most GRID_PX of height (down to 2 px a block)
    const w = $("grid").clientWidth || 300;
    const cell = Math.max(2, Math.min(14, Math.floor(Math.sqrt(w * GRID_PX / Math.max(1, n)))));
    const perRow = Math.max(1, Math.floor(w / cell)), rows = Math.ceil(n / perRow);
    const { g } = canvas("grid", Math.max(cell, rows * cell));
    const gap = cell > 4 ? 1 : 0;
    for (let i = 0; i < n; i++) {
      const v = grid[i];
      g.fillStyle = v === FREE ? COLOR.free : v === CACHED ? COLOR.cached : v === PARKED ? COLOR.parked
        : v === SHARED ? COLOR.shared : PALETTE[v % PALETTE.length];
      g.fillRect((i % perRow) * cell, Math.floor(i / perRow) * cell, cell - gap, cell - gap);
    }
  }

  function drawBatch(snap) {
    const steps = snap.steps.slice(-80), { g, w, h } = canvas("batch");
    const budget = snap.config.token_budget;
    const most = Math.max(1, ...steps.map((s) => s.tokens));
    const top = budget && budget <= 1.5 * most ? budget * 1.05 : most * 1.15;   // a far budget is noted, not drawn
    const bw = w / Math.max(steps.length, 40), y = (v) => h - 14 - (h - 24) * v / top;
    steps.forEach((s, i) => {
      let base = 0;
      for (const kind of ["decode", "prefill"]) {
        const t = s.chunks.filter((c) => c.kind === kind).reduce((a, c) => a + c.tokens, 0);
        if (!t) continue;
        g.fillStyle = COLOR[kind];
        const h1 = Math.max(1, y(base) - y(base + t));
        g.fillRect(i * bw, y(base + t), Math.max(1, bw - 1), h1);
        base += t;
      }
    });
    g.fillStyle = getComputedStyle(document.body).color;
    if (budget && budget <= top) {
      g.fillRect(0, y(budget), w, 1);
      g.fillText("budget " + budget, 4, y(budget) + 12);
    } else {
      g.fillText("most " + most + " tokens a step" + (budget ? "; budget " + budget : ""), 4, 12);
    }
    g.fillStyle = COLOR.prefill; g.fillText("prefill", w - 110, 12);
    g.fillStyle = COLOR.decode; g.fillText("decode", w - 60, 12);
    const table = $("steps");
    table.replaceChildren();
    const head = table.appendChild(LI.el("tr"));
    for (const t of ["step", "tokens", "chunks (request kind tokens@start)", "admitted", "ms"]) head.appendChild(LI.el("th", null, t));
    for (const s of snap.steps.slice(-8).reverse()) {
      const tr = table.appendChild(LI.el("tr"));
      tr.appendChild(LI.el("td", null, s.n));
      tr.appendChild(LI.el("td", null, s.tokens + (s.budget ? " / " + s.budget : "")));
      tr.appendChild(LI.el("td", "text", s.chunks.map((c) => c.id + " " + c.kind + " " + c.tokens + "@" + c.start).join(", ")));
      tr.appendChild(LI.el("td", null, s.admitted.join(" ") + (s.preempted.length ? " preempted " + s.preempted.join(" ") : "")));
      tr.appendChild(LI.el("td", null, LI.fmt(1000 * (s.measured_s === null ? s.wall_s : s.measured_s), 1)));
    }
  }

  function line(g, pts, x, y, color) {
    g.strokeStyle = color;
    g.lineWidth = 1.5;
    g.beginPath();
    let pen = false;
    for (const [a, b] of pts) {
      if (b === null || b === undefined) { pen = false; continue; }
      if (pen) g.lineTo(x(a), y(b)); else g.moveTo(x(a), y(b));
      pen = true;
    }
    g.stroke();
  }

  function drawStepTime(snap) {
    const steps = snap.steps.filter((s) => s.measured_s !== null).slice(-120), { g, w, h } = canvas("steptime");
    const top = Math.max(1e-4, ...steps.map((s) => Math.max(s.measured_s, s.predicted_s || 0)));
    const x = (i) => 30 + (w - 34) * i / Math.max(1, steps.length - 1), y = (v) => h - 12 - (h - 22) * v / top;
    g.fillText(LI.fmt(top * 1000, 1) + " ms", 2, 10);
    line(g, steps.map((s, i) => [i, s.measured_s]), x, y, COLOR.measured);
    line(g, steps.map((s, i) => [i, s.predicted_s]), x, y, COLOR.predicted);
    g.fillStyle = COLOR.measured; g.fillText("measured", w - 120, 12);
    g.fillStyle = COLOR.predicted; g.fillText("predicted", w - 60, 12);
    const err = steps.filter((s) => s.predicted_s).map((s) => Math.abs(s.predicted_s - s.measured_s) / s.measured_s);
    const sm = snap.step_model;
    $("fit").textContent = (sm ? "T = " + LI.fmt(sm.fixed_s * 1000, 2) + " ms + " + LI.fmt(sm.per_token_s * 1e6, 1) +
      " µs/token + " + LI.fmt(sm.per_pair_s * 1e9, 2) + " ns/pair" : "no step model") +
      (err.length ? "; mean |error| " + LI.fmt(100 * err.reduce((a, b) => a + b, 0) / err.length, 1) + "% over " + err.length + " steps" : "");
  }

  function drawRolling() {
    const roll = rolling(engine.history).slice(-120), { g, w, h } = canvas("rolling");
    const panels = [["TTFT s", "ttft", 1], ["ITL ms", "itl", 1000], ["output tok/s", "tps", 1]];
    const pw = w / 3;
    panels.forEach(([label, key, scale], k) => {
      const vals = roll.map((r) => (r[key] === null ? null : r[key] * scale));
      const top = Math.max(1e-6, ...vals.filter((v) => v !== null));
      const x0 = k * pw + 6, x = (i) => x0 + (pw - 16) * i / Math.max(1, roll.length - 1);
      const y = (v) => h - 8 - (h - 32) * v / top;
      g.fillStyle = getComputedStyle(document.body).color;
      g.fillText(label + " (max " + LI.fmt(top, top < 10 ? 2 : 0) + ")", x0, 11);
      line(g, vals.map((v, i) => [i, v]), x, y, PALETTE[k]);
    });
  }

  function cells(tr, values, cls) { for (const v of values) tr.appendChild(LI.el("td", cls, v)); }

  function drawRequests(s, snap) {
    const table = $("requests");
    table.replaceChildren();
    const cols = ["id", "state", "prompt", "output", "cached", "blocks", "preempted", "age s", "TTFT s"];
    if (s.show_prompts) cols.push("text");
    const head = table.appendChild(LI.el("tr"));
    for (const c of cols) head.appendChild(LI.el("th", null, c));
    snap.requests.forEach((r, k) => {
      const tr = table.appendChild(LI.el("tr"));
      const id = LI.el("td", null, r.id);
      if (r.state === "running") id.style.color = PALETTE[k % PALETTE.length];
      tr.appendChild(id);
      cells(tr, [r.state + (r.prefilling ? " (prefill)" : ""), r.prompt_tokens, r.output_tokens + " / " + r.max_tokens,
                 r.cached_tokens, r.blocks, r.preemptions, LI.fmt(r.age_s, 1), LI.fmt(r.ttft_s, 2)]);
      if (s.show_prompts) tr.appendChild(LI.el("td", "text", "…" + (r.prompt || "") + " ⟶ " + (r.output || "")));
    });
    if (!snap.requests.length) table.appendChild(LI.el("tr")).appendChild(LI.el("td", "muted", "idle"));
  }

  function drawFinished(snap) {
    const m = snap.metrics, reasons = $("reasons");
    reasons.replaceChildren();
    const byReason = sumLabelled(m, "localinfer_requests_finished_total");
    const byStatus = sumLabelled(m, "localinfer_requests_rejected_total");
    for (const k in byReason) reasons.appendChild(LI.el("span", null, k + " " + byReason[k]));
    for (const k in byStatus) reasons.appendChild(LI.el("span", "error", "HTTP " + k + " " + byStatus[k]));
    const table = $("finished");
    table.replaceChildren();
    const head = table.appendChild(LI.el("tr"));
    for (const c of ["id", "reason", "prompt", "output", "cached", "TTFT s", "ITL ms", "e2e s"]) head.appendChild(LI.el("th", null, c));
    for (const f of snap.finished.slice().reverse()) {
      const tr = table.appendChild(LI.el("tr"));
      cells(tr, [f.id]);
      const why = LI.el("td", f.refused || f.reason === "error" ? "error text" : "text",
                        (f.refused ? "refused: " : "") + f.reason + (f.error ? " (" + f.error + ")" : ""));
      tr.appendChild(why);
      cells(tr, [f.prompt_tokens, f.output_tokens, f.cached_tokens, LI.fmt(f.ttft_s, 2),
                 f.itl_s === null ? "–" : LI.fmt(1000 * f.itl_s, 1), LI.fmt(f.e2e_s, 2)]);
    }
  }

  function draw(s) {
    const snap = s.snapshot;
    $("age").textContent = s.age_s === null ? "" : "snapshot " + LI.fmt(s.age_s, 2) + " s old";
    $("problem").textContent = s.error ? "the engine view failed: " + s.error : "";
    if (!snap) { $("stats").textContent = "server " + s.state + "…"; return; }
    const h = engine.history;
    if (!h.length || h[h.length - 1].t !== snap.clock_s) {
      h.push({ t: snap.clock_s, m: snap.metrics, out: snap.counts.output_tokens });
      if (h.length > HISTORY) h.shift();
    }
    drawStats(s, snap);
    drawGrid(snap);
    drawBatch(snap);
    drawStepTime(snap);
    drawRolling();
    drawRequests(s, snap);
    drawFinished(snap);
    document.body.dataset.snapshotClock = snap.clock_s;
  }

  async function poll() {
    if (!engine.paused) {
      try {
        const res = await LI.api("/v1/engine/state");
        if (!res.ok) $("problem").textContent = await LI.errorText(res);
        else {
          const s = await res.json();
          engine.last = s;
          draw(s);
          engine.polls++;
        }
      } catch (e) {
        $("problem").textContent = "cannot reach the server: " + (e.message || e);
      }
    }
    setTimeout(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", async () => {
    $("pause").addEventListener("click", () => {
      engine.paused = !engine.paused;
      $("pause").textContent = engine.paused ? "Resume" : "Pause";
    });
    const res = await LI.api("/v1/models");
    if (res.ok) {
      const card = (await res.json()).data[0];
      $("model").textContent = card.id;
    }
    poll();
  });
})();
