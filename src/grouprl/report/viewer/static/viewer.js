// grouprl view: a run's curves, a step's groups and their completions token by token.
// No dependencies, no build. Model text (prompts, completions, token pieces) is only ever
// inserted as text (textContent, title), never parsed as HTML.
(function () {
  "use strict";

  // ----- where the data comes from: this page's server, or the data inside an exported file ---
  const embedded = document.getElementById("grouprl-data");
  const DATA = embedded ? JSON.parse(embedded.textContent) : null;
  function getJSON(url) {
    return fetch(url, { cache: "no-store" }).then(function (r) {
      if (!r.ok) { return r.text().then(function (t) { throw new Error(t || r.statusText); }); }
      return r.json();
    });
  }
  const source = DATA ? {
    runs: function () { return Promise.resolve({ runs: DATA.runs }); },
    step: function (r, s) { return Promise.resolve(DATA.records[r][s]); },
    vocab: function (r) { return Promise.resolve(DATA.vocabs[r]); },
  } : {
    runs: function () { return getJSON("api/runs"); },
    step: function (r, s) { return getJSON("api/run/" + r + "/step/" + s); },
    vocab: function (r) { return getJSON("api/run/" + r + "/vocab"); },
  };

  // ----- colours: one diverging scale (blue, white, red) over [-2, 2], one sequential ---------
  const RED = [202, 0, 32], BLUE = [5, 113, 176], PURPLE = [84, 39, 143];
  const RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
  function mix(end, a) {
    const c = end.map(function (e) { return Math.round(255 + a * (e - 255)); });
    return "rgb(" + c[0] + ", " + c[1] + ", " + c[2] + ")";
  }
  function diverging(u) {
    const t = Math.max(-1, Math.min(1, u / 2));
    return mix(t >= 0 ? RED : BLUE, Math.abs(t));
  }
  function sequential(u) { return mix(PURPLE, Math.max(0, Math.min(1, u))); }

  // ----- state, kept in the address's #fragment so a view can be shared and reloaded ----------
  const state = { step: null, group: 0, channel: "ratio", shown: [0, 1] };
  function readHash() {
    const h = new URLSearchParams(location.hash.slice(1));
    if (h.has("step")) { state.step = Number(h.get("step")); }
    if (h.has("group")) { state.group = Number(h.get("group")); }
    if (h.has("channel")) { state.channel = h.get("channel"); }
    if (h.has("runs")) { state.shown = h.get("runs").split(",").map(Number); }
  }
  function writeHash() {
    const h = new URLSearchParams({ step: state.step, group: state.group,
                                    channel: state.channel, runs: state.shown.join(",") });
    history.replaceState(null, "", "#" + h.toString());
  }

  // ----- small DOM helpers ---------------------------------------------------------------------
  function el(tag, props) {
    const node = document.createElement(tag);
    const children = Array.prototype.slice.call(arguments, 2);
    Object.keys(props || {}).forEach(function (k) {
      if (k === "dataset") { Object.assign(node.dataset, props[k]); }
      else if (k === "style") { Object.assign(node.style, props[k]); }
      else { node[k] = props[k]; }
    });
    children.forEach(function (c) {
      if (c === null || c === undefined) { return; }
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
  }
  function svg(tag, attrs) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    return node;
  }
  function fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) { return "–"; }
    const d = digits === undefined ? 3 : digits;
    const a = Math.abs(x);
    return a !== 0 && (a < Math.pow(10, -d) || a >= 1e5) ? x.toExponential(2) : x.toFixed(d);
  }
  function mean(xs) {
    const v = xs.filter(function (x) { return x !== null; });
    return v.length ? v.reduce(function (a, b) { return a + b; }, 0) / v.length : null;
  }
  function std(xs) {
    const m = mean(xs);
    const v = xs.filter(function (x) { return x !== null; });
    return m === null ? null
      : Math.sqrt(v.reduce(function (a, b) { return a + (b - m) * (b - m); }, 0) / v.length);
  }

  // ----- per-token channels ------------------------------------------------------------------
  // A log-ratio in units of the clip range: 1 at the upper clip (log(1 + clip_high)), -1 at the
  // lower (log(1 - clip_low)), so GRPO's 0.2 and GSPO's 3e-4 read on one scale.
  function clipUnits(lr, rec) {
    if (lr === null || lr === undefined) { return null; }
    return lr >= 0 ? lr / Math.log1p(rec.clip_high) : lr / -Math.log1p(-rec.clip_low);
  }
  const CHANNELS = {
    ratio: {
      label: "log ratio log(π/π_old) the loss used, in clip ranges",
      value: function (c, t, rec) {
        if (!c.logp || !c.trained_mask[t]) { return null; }
        return clipUnits(c.logp[t] - c.old_logp[t], rec);
      },
      colour: diverging, ends: ["−2 clip ranges", "+2"],
    },
    change: {
      label: "log π after the step − log π sampled, in clip ranges",
      value: function (c, t, rec) {
        if (!c.trained_mask[t]) { return null; }
        return clipUnits(c.after_logp[t] - c.sampler_logp[t], rec);
      },
      colour: diverging, ends: ["−2 clip ranges", "+2"],
    },
    advantage: {
      label: "advantage, against the group's largest |Â|",
      value: function (c, t, rec, group) {
        if (!c.trained_mask[t]) { return null; }
        const a = c.token_advantages ? c.token_advantages[t] : c.advantage;
        const scale = group.maxAdvantage || 1;
        return a === null ? null : 2 * a / scale;
      },
      colour: diverging, ends: ["−max |Â|", "+max |Â|"],
    },
    entropy: {
      label: "the sampler's entropy, against the group's largest",
      value: function (c, t, rec, group) {
        if (!c.entropy || !c.trained_mask[t]) { return null; }
        return c.entropy[t] / (group.maxEntropy || 1);
      },
      colour: sequential, ends: ["0", "max H"],
    },
  };

  // ----- the page ----------------------------------------------------------------------------
  let RUNS = [];
  const steps = {}, vocabs = {};
  function loadStep(r, s) {
    const key = r + ":" + s;
    if (!steps[key]) { steps[key] = source.step(r, s); }
    return steps[key];
  }
  function loadVocab(r) {
    if (!vocabs[r]) { vocabs[r] = source.vocab(r); }
    return vocabs[r];
  }

  function shownRuns() {
    const shown = state.shown.filter(function (i) { return i >= 0 && i < RUNS.length; });
    const unique = shown.filter(function (i, k) { return shown.indexOf(i) === k; });
    return unique.length ? unique : [0];
  }

  function renderRunsInfo() {
    const box = document.getElementById("runs-info");
    box.textContent = "";
    RUNS.forEach(function (run, i) {
      const s = run.settings || {};
      const on = shownRuns().indexOf(i) >= 0;
      const box2 = el("input", { type: "checkbox", checked: on, title: "show this run" });
      box2.addEventListener("change", function () {
        const now = shownRuns().filter(function (j) { return j !== i; });
        if (box2.checked) { now.push(i); now.sort(function (a, b) { return a - b; }); }
        state.shown = now.length ? now : [i];
        render();
      });
      const band = s.ratio_level === "token" ? "token ratio" : s.ratio_level + " ratio";
      box.appendChild(el("div", { className: "run-info" }, box2,
        el("span", { className: "swatch", style: { background: RUN_COLOURS[i % 6] } }),
        el("b", {}, run.name), " ",
        (s.algo || "?") + ": " + band + ", clip [1 − " + s.clip_low + ", 1 + " + s.clip_high +
        "], " + s.epochs * s.minibatches + " update(s) per batch, objective " + s.objective +
        (run.finished ? "" : " (running)"),
        run.note ? el("span", { className: "note" }, " — " + run.note) : null));
    });
  }

  const CURVE_PANELS = [
    ["held-out pass@1", function (run) { return [run.evals.step, run.evals.pass_at_1]; }],
    ["reward", function (run) { return [run.curves.step, run.curves.reward_mean]; }],
    ["clipped share", function (run) {
      const lo = run.curves.clip_frac_low || [], hi = run.curves.clip_frac_high || [];
      return [run.curves.step, run.curves.step.map(function (_, k) {
        return lo[k] === null || hi[k] === null || lo[k] === undefined ? null : lo[k] + hi[k];
      })];
    }],
    ["entropy", function (run) { return [run.curves.step, run.curves.entropy]; }],
    ["approx KL", function (run) { return [run.curves.step, run.curves.approx_kl]; }],
    ["zero-variance groups", function (run) { return [run.curves.step, run.curves.frac_zero_std]; }],
    ["routes changed by the step", function (run) { return [run.curves.step, run.curves.routing_update_changed]; }],
    ["routes: sampler vs trainer", function (run) { return [run.curves.step, run.curves.routing_sampler_changed]; }],
  ];

  function renderLayers(box) {  // a mixture-of-experts run: routes changed, steps x layers
    const shown = shownRuns().filter(function (i) { return RUNS[i].layers; });
    if (!shown.length) { return; }
    const run = RUNS[shown[0]], layers = run.layers;
    const steps = layers.step.length, depth = layers.values[0].length;
    const W = 230, H = 110, L = 34, B = 16, T = 14;
    const top = Math.max.apply(null, [].concat.apply([], layers.values).filter(function (v) {
      return v !== null; }).concat([1e-9]));
    const chart = svg("svg", { width: W, height: H, class: "curve" });
    chart.appendChild(svg("text", { x: L, y: 10, class: "title" })).textContent =
      "routes changed per layer" + (shown.length > 1 ? " (" + run.name + ")" : "");
    chart.appendChild(svg("text", { x: 2, y: T + 8 })).textContent = "L" + (depth - 1);
    chart.appendChild(svg("text", { x: 2, y: H - B })).textContent = "L0";
    chart.appendChild(svg("text", { x: L, y: H - 3 })).textContent = String(layers.step[0]);
    chart.appendChild(svg("text", { x: W - 60, y: H - 3 })).textContent =
      String(layers.step[steps - 1]) + " max " + fmt(top, 2);
    const w = (W - L - 4) / steps, h = (H - T - B) / depth;
    layers.values.forEach(function (row, k) {
      row.forEach(function (v, layer) {
        if (v === null) { return; }
        const cell = svg("rect", { x: (L + k * w).toFixed(1), y: (T + (depth - 1 - layer) * h).toFixed(1),
          width: Math.max(w, 1).toFixed(1), height: h.toFixed(1), fill: sequential(v / top) });
        cell.appendChild(svg("title", {})).textContent =
          "step " + layers.step[k] + ", layer " + layer + ": " + fmt(v, 3);
        chart.appendChild(cell);
      });
    });
    box.appendChild(chart);
  }

  function renderCurves() {
    const box = document.getElementById("curves");
    box.textContent = "";
    const W = 230, H = 110, L = 34, B = 16, T = 14;
    CURVE_PANELS.forEach(function (panel) {
      const series = shownRuns().map(function (i) {
        const xy = panel[1](RUNS[i]);
        const pts = (xy[0] || []).map(function (x, k) { return [x, (xy[1] || [])[k]]; })
          .filter(function (p) { return p[1] !== null && p[1] !== undefined; });
        return { i: i, pts: pts };
      });
      const all = [].concat.apply([], series.map(function (s) { return s.pts; }));
      if (!all.length) { return; }
      const xs = all.map(function (p) { return p[0]; }), ys = all.map(function (p) { return p[1]; });
      const x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs) || 1;
      let y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
      if (y1 === y0) { y1 = y0 + 1; }
      const X = function (x) { return L + (W - L - 4) * (x - x0) / ((x1 - x0) || 1); };
      const Y = function (y) { return T + (H - T - B) * (1 - (y - y0) / (y1 - y0)); };
      const chart = svg("svg", { width: W, height: H, class: "curve" });
      chart.appendChild(svg("text", { x: L, y: 10, class: "title" })).textContent = panel[0];
      chart.appendChild(svg("text", { x: 2, y: T + 8 })).textContent = fmt(y1, 2);
      chart.appendChild(svg("text", { x: 2, y: H - B })).textContent = fmt(y0, 2);
      chart.appendChild(svg("text", { x: L, y: H - 3 })).textContent = String(x0);
      chart.appendChild(svg("text", { x: W - 30, y: H - 3 })).textContent = String(x1);
      series.forEach(function (s) {
        const d = s.pts.map(function (p) { return X(p[0]).toFixed(1) + "," + Y(p[1]).toFixed(1); });
        chart.appendChild(svg("polyline", { points: d.join(" "), fill: "none",
          stroke: RUN_COLOURS[s.i % 6], "stroke-width": 1.3 }));
      });
      if (state.step !== null) {
        chart.appendChild(svg("line", { x1: X(state.step), x2: X(state.step), y1: T, y2: H - B,
          stroke: "#888", "stroke-dasharray": "3,2" }));
      }
      chart.addEventListener("click", function (ev) {  // the logged step nearest the click
        const rect = chart.getBoundingClientRect();
        const x = x0 + (ev.clientX - rect.left - L) / (W - L - 4) * (x1 - x0);
        const logged = allSteps();
        if (!logged.length) { return; }
        state.step = logged.reduce(function (a, b) { return Math.abs(b - x) < Math.abs(a - x) ? b : a; });
        render();
      });
      box.appendChild(chart);
    });
    renderLayers(box);
  }

  function allSteps() {
    const set = {};
    shownRuns().forEach(function (i) { (RUNS[i].steps || []).forEach(function (s) { set[s] = 1; }); });
    return Object.keys(set).map(Number).sort(function (a, b) { return a - b; });
  }

  function renderControls() {
    const select = document.getElementById("step-select");
    select.textContent = "";
    const logged = allSteps();
    if (state.step === null || logged.indexOf(state.step) < 0) {
      state.step = logged.length ? logged[logged.length - 1] : null;
    }
    logged.forEach(function (s) { select.appendChild(el("option", { value: s, selected: s === state.step }, String(s))); });
    document.getElementById("channel-select").value = state.channel;
    const ch = CHANNELS[state.channel] || CHANNELS.ratio;
    const legend = document.getElementById("legend");
    legend.textContent = "";
    const stops = [-2, -1, 0, 1, 2].map(function (u) {
      return ch.colour === sequential ? sequential((u + 2) / 4) : diverging(u);
    });
    legend.appendChild(el("span", {}, ch.ends[0]));
    legend.appendChild(el("span", { className: "legend-bar",
      style: { background: "linear-gradient(to right, " + stops.join(", ") + ")" } }));
    legend.appendChild(el("span", {}, ch.ends[1] + " · outlined: the clip acted (solid above, " +
      "dashed below) · grey: not trained (tool output, masked)"));
    const oneUpdate = shownRuns().some(function (i) {
      const s = RUNS[i].settings || {};
      return s.epochs * s.minibatches === 1;
    });
    document.getElementById("channel-note").textContent = state.channel === "ratio" && oneUpdate
      ? "One update per batch: the ratio inside the loss is exactly 1, so nothing is clipped; " +
        "\"change after the step\" shows which tokens the update moved."
      : ch.label;
  }

  function groupStats(g) {
    const rewards = g.rewards;
    const advs = g.completions.map(function (c) { return c.advantage; });
    let maxAdvantage = 0, maxEntropy = 0, clipped = 0, lengths = [];
    g.completions.forEach(function (c) {
      const a = c.token_advantages || [c.advantage];
      a.forEach(function (x) { if (x !== null) { maxAdvantage = Math.max(maxAdvantage, Math.abs(x)); } });
      (c.entropy || []).forEach(function (h, t) { if (c.trained_mask[t]) { maxEntropy = Math.max(maxEntropy, h); } });
      (c.bound || []).forEach(function (b, t) { if (b && c.trained_mask[t]) { clipped += 1; } });
      lengths.push(c.ids.length);
    });
    const scored = rewards.filter(function (x) { return x !== null; });
    const zeroVariance = scored.length === rewards.length &&
      scored.every(function (x) { return x === scored[0]; });
    return { mean: mean(rewards), std: std(rewards), advs: advs, maxAdvantage: maxAdvantage,
             maxEntropy: maxEntropy, clipped: clipped, length: mean(lengths),
             zeroVariance: zeroVariance };
  }

  function renderGroupTable(r, rec, column) {
    const table = el("table", { className: "groups", dataset: { testid: "group-table" } });
    table.appendChild(el("tr", {}, el("th", {}, "#"), el("th", {}, "prompt"),
      el("th", {}, "rewards"), el("th", {}, "mean"), el("th", {}, "σ"), el("th", {}, "Â"),
      el("th", {}, "length"), el("th", {}, "clipped tokens"), el("th", {}, "")));
    rec.groups.forEach(function (g, k) {
      const st = groupStats(g);
      const dots = el("span", {});
      g.completions.forEach(function (c) {
        dots.appendChild(el("span", { className: "dot" + (c.passed === null ? " none" : c.passed ? " pass" : ""),
          title: "reward " + fmt(c.reward) }));
      });
      const advs = st.advs.filter(function (x) { return x !== null; });
      const badges = el("span", {});
      if (st.zeroVariance) {
        badges.appendChild(el("span", { className: "badge", dataset: { testid: "zero-variance-badge" },
          title: "every completion scored the same: the advantages are 0, so the group adds no " +
                 "policy gradient" + (g.trained ? "" : " (it was not trained)") },
          "σ = 0: no gradient"));
      }
      if (st.clipped) { badges.appendChild(el("span", { className: "badge clipped" }, "clipped")); }
      const row = el("tr", { className: "group-row" + (k === state.group ? " selected" : "") +
                            (st.zeroVariance ? " zero-variance" : ""),
                             dataset: { testid: "group-row", group: k } },
        el("td", {}, String(g.index)),
        el("td", { className: "prompt-cell", title: g.prompt }, g.prompt),
        el("td", {}, dots), el("td", {}, fmt(st.mean, 2)), el("td", {}, fmt(st.std, 2)),
        el("td", {}, advs.length ? fmt(Math.min.apply(null, advs), 2) + " … " + fmt(Math.max.apply(null, advs), 2) : "–"),
        el("td", {}, fmt(st.length, 1)), el("td", {}, g.trained ? String(st.clipped) : "not trained"),
        el("td", {}, badges));
      row.addEventListener("click", function () { state.group = k; render(); });
      table.appendChild(row);
    });
    column.appendChild(table);
  }

  function piece(vocab, id) {
    const p = vocab.pieces[id];
    if (p === undefined) { return "⟨" + id + "⟩"; }
    return p.replace(/\n/g, "⏎\n");
  }

  function tokenTitle(c, t, vocab, rec) {
    const lines = ["token " + t + ", id " + c.ids[t] + ": " + JSON.stringify(vocab.pieces[c.ids[t]] || "")];
    lines.push("sampled log π " + fmt(c.sampler_logp[t], 5) + " (π " + fmt(Math.exp(c.sampler_logp[t]), 4) + ")");
    if (!c.trained_mask[t]) { lines.push("not trained (loss mask 0)"); return lines.join("\n"); }
    if (c.logp) {
      lines.push("the loss's log π " + fmt(c.logp[t], 5) + " against log π_old " + fmt(c.old_logp[t], 5));
      lines.push("ratio the loss used " + fmt(c.ratio[t], 6) + (rec.level === "token" ? "" : " (the sequence's)"));
      lines.push(["", "the bound acted: below", "the bound acted: above"][c.bound[t]] || "inside the clip range");
    } else {
      lines.push("not in the update (its group was skipped)");
    }
    if (c.weight) { lines.push("token weight " + fmt(c.weight[t], 3)); }
    if (c.entropy) { lines.push("entropy " + fmt(c.entropy[t], 4)); }
    lines.push("log π after the step " + fmt(c.after_logp[t], 5));
    return lines.filter(Boolean).join("\n");
  }

  function seqRatio(c, rec) {
    if (!c.ratio || rec.level === "token") { return null; }
    for (let t = 0; t < c.ratio.length; t += 1) { if (c.trained_mask[t]) { return c.ratio[t]; } }
    return null;
  }

  function renderCompletion(c, k, g, st, rec, vocab) {
    const s = seqRatio(c, rec);
    const seqClipped = (c.bound || []).some(function (b, t) { return b && c.trained_mask[t]; }) && rec.level !== "token";
    const card = el("div", { className: "completion" + (seqClipped ? " seq-clipped" : ""),
                             dataset: { testid: "completion", row: k } });
    const head = el("div", { className: "completion-head" });
    head.appendChild(el("b", {}, "reward " + fmt(c.reward, 2)));
    const scores = Object.keys(c.scores || {}).map(function (n) { return n + " " + fmt(c.scores[n], 2); });
    if (scores.length) { head.appendChild(el("span", {}, "(" + scores.join(", ") + ")")); }
    if (c.turn_rewards) {  // rewards per turn (–: a turn without one), with each turn's Â
      const turns = c.turn_rewards.map(function (r, i) {
        const a = c.turn_advantages ? " Â " + fmt(c.turn_advantages[i], 3) : "";
        return "turn " + (i + 1) + " " + fmt(r, 2) + a;
      });
      head.appendChild(el("span", { dataset: { testid: "turn-rewards" },
        title: "rewards per turn; each turn's tokens train with its advantage" }, turns.join(" · ")));
    }
    const bar = el("span", { className: "adv-bar", title: "advantage " + fmt(c.advantage) });
    if (c.advantage !== null) {
      const w = 50 * Math.min(1, Math.abs(c.advantage) / (st.maxAdvantage || 1));
      bar.appendChild(el("span", { style: { left: (c.advantage >= 0 ? 50 : 50 - w) + "%", width: w + "%",
        background: diverging(c.advantage >= 0 ? 2 : -2) } }));
    }
    head.appendChild(el("span", {}, "Â " + fmt(c.advantage, 3) + " ", bar));
    head.appendChild(el("span", {}, c.ids.length + " tokens" + (c.truncated ? " (truncated)" : "")));
    if (s !== null) {
      const lo = 1 - rec.clip_low, hi = 1 + rec.clip_high;
      const where = s > hi ? "above" : s < lo ? "below" : "inside";
      head.appendChild(el("span", { dataset: { testid: "seq-ratio", where: where } },
        "sequence ratio s = " + s.toFixed(6) + " against [" + lo.toPrecision(5) + ", " +
        hi.toPrecision(5) + "]: " + where + (seqClipped ? " (clipped: no gradient)" : "")));
    }
    card.appendChild(head);
    const strip = el("div", { className: "strip" });
    const ch = CHANNELS[state.channel] || CHANNELS.ratio;
    const special = {};
    (vocab.special || []).forEach(function (i) { special[i] = 1; });
    c.ids.forEach(function (id, t) {
      let cls = "tok";
      if (!c.trained_mask[t]) { cls += " untrained"; }
      else if (c.bound && c.bound[t] === 2) { cls += " clip-high"; }
      else if (c.bound && c.bound[t] === 1) { cls += " clip-low"; }
      if (special[id]) { cls += " special"; }
      if (c.penalised && c.penalised[t]) { cls += " penalised"; }
      if (c.weight && c.trained_mask[t] && c.weight[t] === 0) { cls += " held-back"; }
      const v = ch.value(c, t, rec, st);
      const span = el("span", { className: cls, title: tokenTitle(c, t, vocab, rec),
                                dataset: { t: t } }, piece(vocab, id));
      if (v !== null && v !== undefined && !Number.isNaN(v)) {
        span.dataset.value = String(v);
        span.style.background = ch.colour(v);
      }
      strip.appendChild(span);
    });
    card.appendChild(strip);
    return card;
  }

  // The prompt's images: PNG data URLs grouprl made from the row's images (never model text),
  // set as the src property of img elements, and only those that are PNG data URLs.
  const THUMBNAIL = "data:image/png;base64,";
  function thumbnails(g) {
    const urls = (Array.isArray(g.images) ? g.images : []).filter(function (u) {
      return typeof u === "string" && u.indexOf(THUMBNAIL) === 0;
    });
    if (!urls.length) { return null; }
    const strip = el("div", { className: "thumbs", dataset: { testid: "images" } });
    urls.forEach(function (u, k) {
      const img = document.createElement("img");
      img.src = u;
      img.alt = "image " + (k + 1) + " of the prompt";
      strip.appendChild(img);
    });
    return strip;
  }

  function renderGroup(r, rec, vocab, column) {
    const g = rec.groups[Math.min(state.group, rec.groups.length - 1)];
    if (!g) { return; }
    const st = groupStats(g);
    const box = el("div", { className: "group-detail", dataset: { testid: "group-detail" } });
    box.appendChild(el("h2", {}, "group " + g.index + ": rewards mean " + fmt(st.mean, 3) +
      ", σ " + fmt(st.std, 3) + (g.answer !== null && g.answer !== undefined ? ", answer " + String(g.answer) : "")));
    box.appendChild(el("div", { className: "prompt", dataset: { testid: "prompt" } },
      g.prompt_ids.map(function (id) { return vocab.pieces[id] || ""; }).join("")));
    const thumbs = thumbnails(g);
    if (thumbs) { box.appendChild(thumbs); }
    if (st.zeroVariance) {
      box.appendChild(el("p", { className: "note" }, "Every completion scored " + fmt(g.rewards[0], 2) +
        ": σ = 0, so every advantage is 0 and this group gives no policy gradient" +
        (g.trained ? "." : "; it was left out of the update, so it has no loss-side values.")));
    }
    const order = g.completions.map(function (c, k) { return k; });
    order.sort(function (a, b) { return (g.completions[b].reward || 0) - (g.completions[a].reward || 0) || a - b; });
    order.forEach(function (k) { box.appendChild(renderCompletion(g.completions[k], k, g, st, rec, vocab)); });
    column.appendChild(box);
  }

  function renderColumns() {
    const box = document.getElementById("columns");
    box.textContent = "";
    const jobs = shownRuns().map(function (i) {
      const run = RUNS[i];
      const column = el("div", { className: "run-column", dataset: { testid: "run-column", run: i } },
        el("h2", {}, el("span", { className: "swatch", style: { background: RUN_COLOURS[i % 6] } }),
           run.name + (state.step === null ? "" : " · step " + state.step)));
      box.appendChild(column);
      if (state.step === null || (run.steps || []).indexOf(state.step) < 0) {
        column.appendChild(el("p", { className: "note" }, run.note ||
          "step " + state.step + " was not logged in this run"));
        return Promise.resolve();
      }
      return Promise.all([loadStep(i, state.step), loadVocab(i)]).then(function (got) {
        renderGroupTable(i, got[0], column);
        renderGroup(i, got[0], got[1], column);
      }).catch(function (err) {
        column.appendChild(el("p", { className: "note" }, "could not load: " + err.message));
      });
    });
    return Promise.all(jobs);
  }

  let rendering = 0;
  function render() {
    rendering += 1;
    const mine = rendering;
    document.body.dataset.ready = "0";
    renderRunsInfo();
    renderControls();
    renderCurves();
    writeHash();
    return renderColumns().then(function () {
      if (mine === rendering) { document.body.dataset.ready = "1"; }
    });
  }

  document.getElementById("step-select").addEventListener("change", function (ev) {
    state.step = Number(ev.target.value);
    render();
  });
  document.getElementById("channel-select").addEventListener("change", function (ev) {
    state.channel = ev.target.value;
    render();
  });
  window.addEventListener("hashchange", function () { readHash(); render(); });

  function refresh() {  // a run still training grows: its curves and logged steps, every 10 s
    source.runs().then(function (got) {
      const before = JSON.stringify(RUNS.map(function (r) { return [r.steps, r.curves.step.length]; }));
      const after = JSON.stringify(got.runs.map(function (r) { return [r.steps, r.curves.step.length]; }));
      if (before !== after) { RUNS = got.runs; render(); }
    }).catch(function () { /* the server stopped: keep what is shown */ });
  }

  readHash();
  source.runs().then(function (got) {
    RUNS = got.runs;
    if (!RUNS.length) { document.getElementById("status").textContent = "no runs"; return; }
    render();
    if (!DATA) { setInterval(refresh, 10000); }
  }).catch(function (err) {
    document.getElementById("status").textContent = "could not load the runs: " + err.message;
  });
})();
