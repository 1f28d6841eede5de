"""The page at ``GET /``: sessions, a conversation, and per-layer memory statistics across turns.

One self-contained HTML document (no external scripts: the server may run offline). It reads
``/v1/sessions`` and ``/v1/memory/{session}`` and draws SVG line charts of each memory layer's
state norms (``||C||``, ``||D||``) and gate means (output gate ``o``, depth gate ``g``) per turn.
Each turn of the conversation names the messages of its request it took in as new and, for an edit
(``lstmem_version``, or a conversation that shares its first messages), the version it rolled back to.

It also runs ``lstmem demo`` interactively ("Try the recall demo", open by default on the
embedded demo model): write a history of facts ``kNN vNN ;`` into a session
(``POST /v1/memory/{session}/write``), ask ``? kNN`` with the session (``POST
/v1/chat/completions`` with ``X-Session-Id``: the answer from memory, greedy, one token) and
without one (no history), see gold (the newest value written for that key) beside both answers,
and watch the session's charts gain a point per write and question. A request the server refuses
(a question or history with words the model has no token for, a session name it does not take) shows
the server's error message in red under the question, and adds no row. A select beside the question
sets what asking writes into the session's memory (``lstmem_write``): ``messages`` (the question,
the server's default) unless changed, ``messages_and_answer`` (the question and the answer) or
``none`` (read only). Each question's position since the session's last write from the page is in
the table, and below it the recall from memory by question position so far (the shipped adapters
are trained for a conversation: a written question does not erase the facts it asks about).
``/?demo=N&ask=M`` does it unattended: a random history of ``N`` facts, then ``M`` questions about
it.
"""

PAGE = r"""<!doctype html>
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
.muted{color:#888} #side input{width:100%;box-sizing:border-box;margin-bottom:8px}
#demo{border:1px solid #ddd;padding:8px 12px;margin-bottom:12px;background:#fcfcf7}
#demo textarea{width:100%;box-sizing:border-box;font:13px monospace}
#demo input{margin:0 8px 6px 4px} #demo table{border-collapse:collapse;margin-top:6px}
#demo td,#demo th{border-bottom:1px solid #eee;padding:2px 10px;text-align:left;font-family:monospace}
.right{color:#27632a} .wrong{color:#b42318}
</style></head><body>
<div id="side"><h1>lstmem serve</h1>
<input id="key" placeholder="API key (if the server needs one)">
<div id="sessions" class="muted">loading sessions...</div></div>
<div id="main">
<details id="demo"><summary><b>Try the recall demo</b> <span class="muted">(the embedded demo model:
facts <code>kNN vNN ;</code>, questions <code>? kNN</code>)</span></summary>
<p class="muted">Write a history into a session's memory, then ask about it: the question is sent alone
(the history is not in the context), once with the session (the answer comes from memory) and once
without (no history). Each write and question is a point on the session's charts below.</p>
<div>session <input id="dsid" value="demo" size="12"> facts <input id="dn" type="number" value="8" min="1"
max="512" style="width:5em"><button id="dgen">New random history</button></div>
<textarea id="dhist" rows="3"></textarea>
<div><button id="dwrite">Write into memory</button> <span id="dstatus" class="muted"></span></div>
<div style="margin-top:6px">question <input id="dq" value="? k07" size="10"><button id="dask">Ask</button>
<button id="dask3">Ask 4 written keys</button>
<label title="lstmem_write: what asking with the session writes into its memory">writes
<select id="dwritepolicy"><option value="messages" selected>the question (the default)</option>
<option value="messages_and_answer">the question and the answer</option>
<option value="none">nothing (read only)</option></select></label></div>
<div id="derror" class="wrong" role="alert"></div>
<table id="dtable"><thead><tr><th>question</th><th>gold (newest written)</th><th>from memory</th>
<th>without history</th><th title="the question's position since the session's last write">Q</th></tr></thead>
<tbody></tbody></table><div id="dbypos" class="muted"></div></details>
<div id="title" class="muted">Pick a session on the left.</div>
<div id="summary"></div><h2>Memory across turns</h2><div id="charts"></div>
<h2>Conversation</h2><div id="conv"></div></div>
<script>
const key = document.getElementById('key');
key.value = new URLSearchParams(location.search).get('key') || localStorage.getItem('lstmem-key') || '';
key.onchange = () => { localStorage.setItem('lstmem-key', key.value); load(); };
const hdr = () => key.value ? {Authorization: 'Bearer ' + key.value} : {};
const esc = s => String(s).replace(/[&<>"]/g, c => ({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));
// a turn's new messages (indices into its request), as "2-5", "3" or "none"
const span = n => n.length ? n[0] + (n.length > 1 ? '-' + n[n.length - 1] : '') : 'none';
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
async function load(prefer) {
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
  const want = prefer || new URLSearchParams(location.search).get('session') || (data[0] && data[0].id);
  if (want) await show(want);
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
    `<div class="turn"><div class="who">#${i+1} ${esc(t.kind)}, ${t.written} tokens written` +
    `${t.write ? ' (lstmem_write ' + esc(t.write) + ')' : ''}` +
    `${t.rolled_back_to != null ? ', rolled back to version ' + t.rolled_back_to : ''}` +
    `${t.new_messages ? ', new messages ' + span(t.new_messages) + ' of the request' : ''}</div>` +
    `${esc(t.input)}</div>` +
    (t.answer ? `<div class="turn ans"><div class="who">answer</div>${esc(t.answer)}</div>` : '')).join('');
}
// ---------------------------------------------------------------- the recall demo
const $ = id => document.getElementById(id);
const two = i => String(i).padStart(2, '0');
const written = {};  // session -> {key: newest value written from this page}
const asked = {};  // session -> {n: questions since its last write, by: [[right, asked] per position]}
let modelId = null;
async function model() {
  if (modelId) return modelId;
  const r = await fetch('/v1/models', {headers: hdr()});
  modelId = r.ok ? (await r.json()).data[0].id : 'default';
  return modelId;
}
function randomHistory(n) {  // keys distinct up to 32 facts, then each comes back with a new value
  const facts = []; let pool = [];
  for (let i = 0; i < n; i++) {
    if (!pool.length) { pool = [...Array(32).keys()].sort(() => Math.random() - 0.5); }
    facts.push(`k${two(pool.pop())} v${two(Math.floor(Math.random() * 32))} ;`);
  }
  return facts.join(' ');
}
async function demoWrite() {
  const sid = $('dsid').value.trim(), text = $('dhist').value.trim();
  if (!sid || !text) { $('dstatus').textContent = 'a session and a history, please'; return false; }
  $('dstatus').textContent = 'writing...';
  const r = await fetch('/v1/memory/' + encodeURIComponent(sid) + '/write', {method: 'POST',
    headers: {...hdr(), 'Content-Type': 'application/json'},
    body: JSON.stringify({messages: [{role: 'user', content: text}]})});
  const j = await r.json();
  if (!r.ok) { $('dstatus').textContent = 'write refused'; $('derror').textContent = refusal(j, r); return false; }
  $('derror').textContent = '';
  const mine = written[sid] = written[sid] || {};
  (asked[sid] = asked[sid] || {n: 0, by: []}).n = 0;  // positions count from this write
  for (const m of text.matchAll(/\b(k\d\d)\s+(v\d\d)\b/g)) mine[m[1]] = m[2];
  $('dstatus').textContent = `${j.tokens_written} tokens written; the session holds ${j.session_tokens_written}`;
  const keys = Object.keys(mine);
  if (keys.length) $('dq').value = '? ' + keys[Math.floor(Math.random() * keys.length)];
  await load(sid);
  return true;
}
async function answer(q, sid) {
  const headers = {...hdr(), 'Content-Type': 'application/json'};
  if (sid) headers['X-Session-Id'] = sid;
  const body = {model: await model(), messages: [{role: 'user', content: q}], max_tokens: 1, temperature: 0};
  if (sid) body.lstmem_write = $('dwritepolicy').value;  // what asking writes into the session
  const r = await fetch('/v1/chat/completions', {method: 'POST', headers, body: JSON.stringify(body)});
  const j = await r.json();
  if (!r.ok) throw new Error(refusal(j, r));
  return j.choices[0].message.content.trim();
}
// the server's own words for a refused request (a question the model cannot read names its vocabulary)
const refusal = (j, r) => 'error ' + r.status + ': ' + (j.error ? j.error.message : r.statusText);
async function demoAsk(q) {
  const sid = $('dsid').value.trim();
  const key = (q.match(/k\d\d/) || [])[0], gold = (written[sid] || {})[key] || '(not written here)';
  let mem, none;
  try { mem = await answer(q, sid); none = await answer(q, null); } catch (e) {
    $('derror').textContent = e.message;  // nothing was answered or written: no row, no point
    return;
  }
  $('derror').textContent = '';
  const mark = a => a === gold ? 'right">' + esc(a) + ' &#10003;' : 'wrong">' + esc(a) + ' &#10007;';
  const cell = a => `<td class="${mark(a)}</td>`;
  const s = asked[sid] = asked[sid] || {n: 0, by: []}, pos = s.n++;
  const at = s.by[pos] = s.by[pos] || [0, 0];
  at[0] += mem === gold ? 1 : 0; at[1] += 1;
  $('dtable').tBodies[0].insertAdjacentHTML('beforeend',
    `<tr class="demo-row"><td>${esc(q)}</td><td>${esc(gold)}</td>${cell(mem)}${cell(none)}<td>Q${pos + 1}</td></tr>`);
  $('dbypos').textContent = `recall from memory by question position (session ${sid}, this page): ` +
    s.by.map((c, i) => `Q${i + 1} ${c[0]}/${c[1]}`).join(' \u00b7 ');
  await load(sid);
}
async function demoAskWritten(n) {
  const keys = Object.keys(written[$('dsid').value.trim()] || {}).sort(() => Math.random() - 0.5);
  for (const k of keys.slice(0, n)) await demoAsk('? ' + k);
}
$('dgen').onclick = () => { $('dhist').value = randomHistory(Math.max(1, +$('dn').value || 8)); };
$('dwrite').onclick = demoWrite;
$('dask').onclick = () => demoAsk($('dq').value.trim());
$('dask3').onclick = () => demoAskWritten(4);
$('dhist').value = randomHistory(8);
(async () => {
  const params = new URLSearchParams(location.search);
  if ((await model()) === 'lstmem-demo' || params.get('demo')) $('demo').open = true;
  if (params.get('demo')) {  // /?demo=N&ask=M: write N random facts, ask M of them
    $('dn').value = +params.get('demo') || 8;
    if (params.get('session')) $('dsid').value = params.get('session');
    $('dhist').value = randomHistory(+$('dn').value);
    if (await demoWrite()) await demoAskWritten(+params.get('ask') || 4);
  } else {
    load();
  }
})();
</script></body></html>
"""
