// fairgate dashboard: polls /dashboard/data with the key kept in sessionStorage, draws Chart.js line charts.
// The scope (every tenant, or only "you") is decided by the server from the key; this page only draws it.
(function () {
  "use strict";

  var STORAGE = "fairgate.dashboard.key";
  var REFRESH_MS = 2500;
  var PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
  var charts = {};
  var timer = null;
  var inFlight = false;
  var sampleEverySeconds = 5;
  window.fairgateCharts = charts; // for tests and the curious: id -> Chart

  function $(id) { return document.getElementById(id); }

  function colour(index) { return PALETTE[index % PALETTE.length]; }

  function chart(id, title, yTitle, y1Title) {
    var scales = {
      x: { type: "linear", title: { display: true, text: "seconds ago" } },
      y: { beginAtZero: true, title: { display: true, text: yTitle } }
    };
    if (y1Title) {
      scales.y1 = { beginAtZero: true, position: "right", grid: { drawOnChartArea: false },
                    title: { display: true, text: y1Title } };
    }
    charts[id] = new window.Chart($(id), {
      type: "line",
      data: { datasets: [] },
      options: {
        animation: false, parsing: false, normalized: true, responsive: true, maintainAspectRatio: false,
        spanGaps: false, elements: { point: { radius: 0 }, line: { borderWidth: 2 } },
        interaction: { mode: "nearest", intersect: false },
        scales: scales,
        plugins: { title: { display: true, text: title }, legend: { position: "bottom" } }
      }
    });
    return charts[id];
  }

  // A sample with no value (a tenant idle then, or no sample taken: the gateway was down) is a gap in the line,
  // not a straight line drawn across it: null points, and spanGaps off.
  function points(t, values) {
    var out = [];
    if (!values) { return out; }
    for (var i = 0; i < t.length; i++) {
      if (i > 0 && t[i] - t[i - 1] > 2 * sampleEverySeconds) { out.push({ x: t[i - 1] + sampleEverySeconds, y: null }); }
      var v = values[i];
      out.push({ x: t[i], y: v === null || v === undefined ? null : v });
    }
    return out;
  }

  function line(label, data, index, extra) {
    var d = { label: label, data: data, borderColor: colour(index), backgroundColor: colour(index) };
    if (extra) { for (var k in extra) { d[k] = extra[k]; } }
    return d;
  }

  function set(id, title, datasets) {
    var c = charts[id];
    if (title) { c.options.plugins.title.text = title; }
    c.data.datasets = datasets;
    c.update("none");
  }

  function buildCharts() {
    if (charts.share) { return; }
    chart("share", "GPU share", "share (0-1)");
    chart("queue", "Queue time p99 (last window)", "ms");
    chart("admissions", "Admissions (solid) vs rejections (dashed)", "requests / s");
    chart("active", "Active sequences (solid), queued (dashed)", "requests");
    chart("tokens", "Tokens: output (solid), input (dashed)", "tokens / s");
    chart("gpu", "GPU seconds charged (cumulative)", "GPU s");
    chart("gap", "Reserved minus settled (last window): GPU s (solid), output tokens (dashed)", "GPU s", "tokens");
    chart("slo", "Shared pool SLO: TTFT p99 (queue incl.) vs target", "ms");
    chart("fairness", "Fairness over the window: max/min (solid), Jain (dashed)", "max/min", "Jain");
    chart("busy", "Upstream busy fraction", "fraction");
  }

  function render(data) {
    var admin = data.scope === "admin";
    sampleEverySeconds = data.sample_every_s;
    document.body.classList.toggle("tenant", !admin);
    var status = $("status");
    status.dataset.scope = data.scope;
    status.textContent = (admin ? "administrator: all tenants" : "tenant: your data only") +
      " · updated " + new Date(data.now_s * 1000).toLocaleTimeString() + " · " + data.t.length + " samples";
    var t = data.t;
    var names = Object.keys(data.series).sort();
    var per = function (field, extra) {
      return names.map(function (name, i) { return line(name, points(t, data.series[name][field]), i, extra); });
    };
    var dashed = { borderDash: [6, 4] };
    var pair = function (a, b, suffixA, suffixB, extraB) {
      var out = [];
      names.forEach(function (name, i) {
        out.push(line(name + suffixA, points(t, data.series[name][a]), i));
        out.push(line(name + suffixB, points(t, data.series[name][b]), i, extraB || dashed));
      });
      return out;
    };
    set("share", admin ? "GPU share of the pool's charged GPU time (last " + data.window_s + " s)"
                       : "Your GPU time as a share of the pool's capacity (last " + data.window_s + " s)",
        per(admin ? "gpu_share" : "capacity_share"));
    set("queue", null, per("queue_p99_ms"));
    set("admissions", null, pair("admissions_per_s", "rejections_per_s", "", " rejected"));
    set("active", null, pair("running", "queued", "", " queued"));
    set("tokens", null, pair("output_tokens_per_s", "input_tokens_per_s", " out", " in"));
    set("gpu", null, per("gpu_s"));
    set("gap", null, pair("reserve_gap_gpu_s", "reserve_gap_output_tokens", " GPU s", " tokens",
                          { borderDash: [6, 4], yAxisID: "y1" }));
    var models = Object.keys(data.pool.ttft_incl_queue_p99_ms).sort();
    var slo = models.map(function (m, i) {
      return line(m + " TTFT p99 (queue incl.)", points(t, data.pool.ttft_incl_queue_p99_ms[m]), i);
    });
    if (t.length) {
      var target = data.pool.ttft_target_ms;
      slo.push(line("target", [{ x: t[0], y: target }, { x: t[t.length - 1], y: target }], PALETTE.length - 1,
                    { borderDash: [2, 2] }));
    }
    set("slo", null, slo);
    if (admin) {
      var fair = [];
      Object.keys(data.pool.max_min).sort().forEach(function (m, i) {
        fair.push(line(m + " max/min", points(t, data.pool.max_min[m]), i));
        fair.push(line(m + " Jain", points(t, data.pool.jain[m]), i, { borderDash: [6, 4], yAxisID: "y1" }));
      });
      set("fairness", null, fair);
      set("busy", null, Object.keys(data.pool.busy).sort().map(function (u, i) {
        return line(u, points(t, data.pool.busy[u]), i);
      }));
    } else {
      set("fairness", null, []);
      set("busy", null, []);
    }
    renderTotals(data);
    $("footnote").textContent = "One sample every " + data.sample_every_s + " s; shares, p99s and gaps over the last " +
      data.window_s + " s; rates since the previous sample.";
  }

  // An amount of the pricing currency: to the cent, or to 1/10,000 below one unit (a request costs little).
  function money(value, currency) {
    return (value >= 1 ? value.toFixed(2) : value.toFixed(4)) + " " + currency;
  }

  function cell(row, text) {
    var td = document.createElement("td");
    td.textContent = text;
    row.appendChild(td);
  }

  function renderTotals(data) {
    var body = $("totals").querySelector("tbody");
    while (body.firstChild) { body.removeChild(body.firstChild); }
    // No [quotas.pricing]: every amount would be a made-up 0, so there is no spend column at all.
    $("spend-head").hidden = !data.priced;
    Object.keys(data.totals).sort().forEach(function (name) {
      var x = data.totals[name];
      var row = document.createElement("tr");
      var reasons = Object.keys(x.rejections).map(function (r) { return r + " " + x.rejections[r]; }).join(", ");
      var rejected = Object.keys(x.rejections).reduce(function (s, r) { return s + x.rejections[r]; }, 0);
      cell(row, name + (x.demand_limited ? " (demand-limited)" : ""));
      cell(row, String(x.admissions));
      cell(row, rejected + (reasons ? " (" + reasons + ")" : ""));
      cell(row, String(x.input_tokens));
      cell(row, String(x.output_tokens));
      cell(row, x.gpu_s.toFixed(3));
      cell(row, x.reserved_gpu_s.toFixed(3) + " / " + x.settled_gpu_s.toFixed(3));
      cell(row, String(x.reserved_output_tokens));
      if (data.priced) { cell(row, money(x.spend, data.currency)); }
      body.appendChild(row);
    });
  }

  function signedIn(on) {
    $("login-section").hidden = on;
    $("board").hidden = !on;
    $("logout").hidden = !on;
  }

  function signOut(message) {
    sessionStorage.removeItem(STORAGE);
    if (timer) { clearInterval(timer); timer = null; }
    signedIn(false);
    $("status").textContent = "signed out";
    $("status").dataset.scope = "";
    $("error").textContent = message || "";
  }

  function poll() {
    var key = sessionStorage.getItem(STORAGE);
    if (!key || inFlight) { return; }
    inFlight = true;
    fetch("/dashboard/data", { headers: { "Authorization": "Bearer " + key }, cache: "no-store" })
      .then(function (reply) {
        return reply.json().then(function (body) { return { ok: reply.ok, status: reply.status, body: body }; });
      })
      .then(function (r) {
        if (sessionStorage.getItem(STORAGE) !== key) { return; } // signed out (or in again) meanwhile
        if (!r.ok) {
          var message = (r.body && r.body.error && r.body.error.message) || ("HTTP " + r.status);
          if (r.status === 401 || r.status === 403 || r.status === 400) { signOut(message); }
          else { $("error").textContent = message; }
          return;
        }
        signedIn(true);
        buildCharts();
        render(r.body);
      })
      .catch(function (e) { $("status").textContent = "gateway unreachable: " + e; })
      .then(function () { inFlight = false; });
  }

  // A sign-in link (/dashboard#signin=fgdash_...): its token is kept like a key, then taken out of the address
  // bar so that it is not bookmarked, shared or kept in the history. Returns whether there was one.
  function takeLink() {
    var match = /^#signin=(fgdash_[A-Za-z0-9_.-]+)$/.exec(window.location.hash);
    if (!match) { return false; }
    sessionStorage.setItem(STORAGE, match[1]);
    window.history.replaceState(null, "", window.location.pathname + window.location.search);
    $("error").textContent = "";
    return true;
  }

  function start() {
    poll();
    if (!timer) { timer = setInterval(poll, REFRESH_MS); }
  }

  document.addEventListener("DOMContentLoaded", function () {
    $("login").addEventListener("submit", function (event) {
      event.preventDefault();
      var key = $("key").value.trim();
      $("key").value = "";
      if (!key) { return; }
      $("error").textContent = "";
      sessionStorage.setItem(STORAGE, key);
      start();
    });
    $("logout").addEventListener("click", function () { signOut(""); });
    window.addEventListener("hashchange", function () { if (takeLink()) { start(); } });
    takeLink();
    if (sessionStorage.getItem(STORAGE)) { start(); }
  });
}());
