"""The page at ``GET /``: sessions, a conversation, and per-layer memory statistics across turns.

One self-contained HTML document (no external scripts: the server may run offline). It reads
``/v1/sessions`` and ``/v1/memory/{session}`` and draws SVG line charts of each memory layer's
state norms (``||C||``, ``||D||``) and gate means (output gate ``o``, depth gate ``g``) per turn.
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>lstmem serve</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;display:flex;height:100vh;color:#222}
#side{width:230px;border-right:1px solid #ddd;padding:12px;overflow:auto;background:#fafafa}
#main{flex:1;padding:16px;overflow:auto}
h1{font-size:16px;margin:0 0 8px} h2{font-size:15px;margin:16px 0 6px}
.s{padding:6px;cursor:pointer;border-radius:4px} .s:hover,.s.on{background:#e6eefc}
.turn{border-left:3px solid #bcd;padding:4px 8px;margin:6px 0;white-space:pre-wrap}
.turn .who{color:#667;font-size:12px} .ans{border-color:#7b5}
#charts{display:flex;flex-wrap:wrap;gap:12px} .chart{border:1px solid #ddd;padding:6px}
.muted{color:#888} input{width:100%;box-sizing:border-box;margin-bottom:8px}
</style></head><body>
<div id="side"><h1>lstmem serve</h1>
<input id="key" placeholder="API key (if the server needs one)">
<div id="sessions" class="muted">loading sessions...</div></div>
<div id="main"><div id="title" class="muted">Pick a session on the left.</div>
<div id="summary"></div><h2>Memory across turns</h2><div id="charts"></div>
<h2>Conversation</h2><div id="conv"></div></div>
<script>
const key = document.getElementById('key');
key.value = new URLSearchParams(location.search).get('key') || localStorage.getItem('lstmem-key') || '';
key.onchange = () => { localStorage.setItem('lstmem-key', key.value); load(); };
const hdr = () => key.value ? {Authorization: 'Bearer ' + key.value} : {};
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
const COLORS = ['#1f77b4','#d62728','#2ca02c','#9467bd','#ff7f0e','#8c564b','#e377c2','#17becf'];
function chart(title, series) {
  const W = 320, H = 170, P = 30;
  const pts = series.flatMap(s => s.values.filter(v => v !== null && v !== undefined));
  const n = Math.max(1, ...series.map(s => s.values.length));
  let lo = Math.min(0, ...pts), hi = Math.max(1e-9, ...pts);
  const x = i => P + (n === 1 ? (W - 2 * P) / 2 : i * (W - 2 * P) / (n - 1));
  const y = v => H - P - (v - lo) / (hi - lo) * (H - 2 * P);
  let svg = `<svg width="${W}" height="${H}" role="img" aria-label="${esc(title)}">`;
  svg += `<text x="${P}" y="14" font-size="12">${esc(title)}</text>`;
  svg += `<line x1="${P}" y1="${H-P}" x2="${W-P}" y2="${H-P}" stroke="#999"/>`;
  svg += `<line x1="${P}" y1="${P}" x2="${P}" y2="${H-P}" stroke="#999"/>`;
  svg += `<text x="2" y="${P+4}" font-size="10">${hi.toFixed(2)}</text>`;
  svg += `<text x="2" y="${H-P}" font-size="10">${lo.toFixed(2)}</text>`;
  svg += `<text x="${W/2-10}" y="${H-8}" font-size="10">turn</text>`;
  series.forEach((s, k) => {
    const c = COLORS[k % COLORS.length];
    const p = s.values.map((v, i) => v === null || v === undefined ? null : [x(i), y(v)]).filter(Boolean);
    const line = p.map(q => q.join(',')).join(' ');
    if (p.length) svg += `<polyline fill="none" stroke="${c}" stroke-width="2" points="${line}"/>`;
    p.forEach(q => svg += `<circle cx="${q[0]}" cy="${q[1]}" r="2.5" fill="${c}"/>`);
    svg += `<text x="${W-P-70}" y="${P+12*k}" font-size="10" fill="${c}">${esc(s.name)}</text>`;
  });
  return `<div class="chart">${svg}</svg></div>`;
}
async function load() {
  const r = await fetch('/v1/sessions', {headers: hdr()});
  const box = document.getElementById('sessions');
  if (!r.ok) { box.textContent = 'cannot list sessions: ' + r.status; return; }
  const data = (await r.json()).data;
  box.innerHTML = data.length ? '' : 'no sessions yet';
  data.forEach(s => {
    const d = document.createElement('div'); d.className = 's'; d.dataset.id = s.id;
    d.innerHTML = `<b>${esc(s.id)}</b><br><span class="muted">${s.turns} turns, ${s.tokens_written} tokens</span>`;
    d.onclick = () => show(s.id); box.appendChild(d);
  });
  const want = new URLSearchParams(location.search).get('session') || (data[0] && data[0].id);
  if (want) show(want);
}
async function show(id) {
  document.querySelectorAll('.s').forEach(e => e.classList.toggle('on', e.dataset.id === id));
  const r = await fetch('/v1/memory/' + encodeURIComponent(id), {headers: hdr()});
  if (!r.ok) return;
  const m = await r.json();
  document.getElementById('title').innerHTML = `<h1>Session ${esc(id)}</h1>`;
  document.getElementById('summary').innerHTML =
    `${m.tokens_written} tokens written in ${m.turns.length} commits; ${m.state_bytes} bytes of state; ` +
    `${m.layers.length} memory layers; layout ${esc(m.fingerprint)}`;
  const L = m.layers.length, T = m.turns;
  const per = (f) => Array.from({length: L}, (_, l) => ({name: 'layer ' + m.layers[l].layer_index,
    values: T.map(t => f(t, l))}));
  document.getElementById('charts').innerHTML =
    chart('||C|| (cell norm)', per((t, l) => t.norms && t.norms.cell.length ? t.norms.cell[l] : null)) +
    chart('||D|| (hidden norm)', per((t, l) => t.norms && t.norms.hidden.length ? t.norms.hidden[l] : null)) +
    chart('output gate o (mean)', per((t, l) => t.gates ? t.gates.out_gate[l] : null)) +
    chart('depth gate g (mean)', per((t, l) => t.gates ? t.gates.depth_gate[l] : null));
  document.getElementById('conv').innerHTML = T.map((t, i) =>
    `<div class="turn"><div class="who">#${i+1} ${esc(t.kind)}, ${t.written} tokens written</div>` +
    `${esc(t.input)}</div>` +
    (t.answer ? `<div class="turn ans"><div class="who">answer</div>${esc(t.answer)}</div>` : '')).join('');
}
load();
</script></body></html>
"""
