// The router's fleet page (kvtransfer/router/web/fleet_page.py): polls dashboard/state and
// draws it; no framework, no build step. Every string that comes from the fleet (addresses,
// states, model names, error messages) is written as text (textContent, setAttribute), never
// parsed as markup: an address is whatever someone registered.
'use strict';

const ROLES = ['prefill', 'decode', 'aggregated'];
const TOKEN_KEY = 'kvtransfer.router.adminToken';
const SVG_NS = 'http://www.w3.org/2000/svg';
// The KV handover's spans get a lane of their own, between the prefill's and the decode's.
const KV_SPANS = new Set([
  'prefill.kv.save_layer',
  'decode.kv.handshake',
  'decode.kv.read',
  'decode.kv.keys',
]);
const LANES = ['router', 'prefill', 'KV', 'decode'];
const INSTANCE_COLUMNS = [
  ['address', 'Address'],
  ['source', 'Source'],
  ['health', 'Health'],
  ['breaker', 'Breaker'],
  ['in_flight', 'In flight', 'num', 'requests this router runs on it now'],
  ['picks', 'Picks', 'num', 'times its role\'s policy picked it (retries included)'],
  ['load', 'Run / wait', 'num', 'running / waiting requests, as it last reported'],
  ['kv', 'KV used', 'num', 'KV blocks in use / in all, as it last reported'],
  ['index', 'Index', 'num', 'prefix blocks the router\'s index scores it by (cache_aware)'],
  ['action', ''],
];
const REQUEST_COLUMNS = [
  'arrived', 'id', 'status', 'prompt', 'out', 'route', 'kv_stream', 'retries', 'ttft', 'total',
  'error',
];

const query = new URLSearchParams(window.location.search);
const INTERVAL_MS = clamp(Number(query.get('interval_ms')) || 1000, 100, 60000);

const page = {
  selected: null, // the request whose timeline is shown
  followNewest: true, // until a request is clicked
  drawn: null,
  timer: null,
  polling: false,
  again: false,
  sections: new Map(),
};

function clamp(value, low, high) {
  return Math.min(high, Math.max(low, value));
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

function svgEl(tag, attributes) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    node.setAttribute(name, String(value));
  }
  return node;
}

function dash(value) {
  return value === null || value === undefined ? '—' : String(value);
}

function ms(value) {
  return typeof value === 'number' ? value.toFixed(1) : '—';
}

function duration(seconds) {
  const s = Math.floor(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  return h ? `${h}h ${m}m` : m ? `${m}m ${s % 60}s` : `${s}s`;
}

// ---------------------------------------------------------------------------- polling

async function poll() {
  if (page.polling) {
    page.again = true; // an admin call changed the fleet: look again once this poll ends
    return;
  }
  page.polling = true;
  clearTimeout(page.timer);
  try {
    const response = await fetch('dashboard/state', { cache: 'no-store', credentials: 'omit' });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    setConnection('live', `live, updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    setConnection('down', `state unavailable: ${error.message}`);
  } finally {
    page.polling = false;
    if (page.again) {
      page.again = false;
      poll();
    } else {
      page.timer = setTimeout(poll, INTERVAL_MS);
    }
  }
}

function setConnection(state, text) {
  const node = document.getElementById('connection');
  node.dataset.state = state;
  node.textContent = text;
}

function render(state) {
  renderRouter(state.router);
  for (const role of ROLES) renderRole(role, state.instances[role] || []);
  renderRequests(state.requests);
}

function renderRouter(router) {
  const facts = [
    ['model', router.model],
    ['engine', router.engine],
    ['up', duration(router.uptime_s)],
    ['running', `${router.running} (max ${router.max_running || '∞'})`],
    ['queued', `${router.queued} (max ${router.max_queued})`],
    ['policies', `prefill ${router.policies.prefill}, decode ${router.policies.decode}`],
    ['admin API', router.admin_api ? 'on' : 'off'],
  ];
  const list = document.getElementById('router-facts');
  list.replaceChildren();
  for (const [name, value] of facts) {
    const item = el('div');
    item.dataset.fact = name;
    item.append(el('dt', name), el('dd', value));
    list.append(item);
  }
}

// ---------------------------------------------------------------------------- instances

function roleSection(role) {
  let section = page.sections.get(role);
  if (section) return section;
  section = el('section', null, 'role');
  section.dataset.role = role;
  const title = el('h3', role);
  const count = el('span', '', 'muted count');
  title.append(' ', count);
  const table = el('table');
  const head = el('tr');
  for (const [name, label, kind, explained] of INSTANCE_COLUMNS) {
    const cell = el('th', label, kind);
    cell.dataset.col = name;
    if (explained) cell.title = explained;
    head.append(cell);
  }
  table.append(el('thead'), el('tbody'));
  table.tHead.append(head);
  section.append(title, table, el('p', `No ${role} instance.`, 'muted empty'));
  document.getElementById('roles').append(section);
  page.sections.set(role, section);
  return section;
}

function renderRole(role, instances) {
  const section = roleSection(role);
  section.hidden = role === 'aggregated' && instances.length === 0;
  section.querySelector('.count').textContent = `(${instances.length})`;
  section.querySelector('.empty').hidden = instances.length > 0;
  const body = section.querySelector('tbody');
  const rows = new Map(Array.from(body.rows, (row) => [row.dataset.address, row]));
  instances.forEach((instance, position) => {
    let row = rows.get(instance.address);
    rows.delete(instance.address);
    if (!row) row = instanceRow();
    fillInstance(row, instance);
    if (body.rows[position] !== row) body.insertBefore(row, body.rows[position] || null);
  });
  for (const gone of rows.values()) gone.remove();
}

function instanceRow() {
  const row = el('tr');
  for (const [name, , kind] of INSTANCE_COLUMNS) {
    const cell = el('td', null, kind);
    cell.dataset.col = name;
    row.append(cell);
  }
  const remove = el('button', 'Remove', 'remove');
  remove.type = 'button';
  remove.dataset.action = 'remove';
  cell(row, 'action').append(remove);
  return row;
}

function cell(row, name) {
  return Array.from(row.cells).find((c) => c.dataset.col === name);
}

function health(instance) {
  if (instance.healthy) return 'healthy';
  return instance.state === 'NOT_CHECKED' ? 'unchecked' : 'unhealthy';
}

function badge(text, kind) {
  const node = el('span', text, 'badge');
  node.dataset.kind = kind;
  return node;
}

function fillInstance(row, instance) {
  const state = health(instance);
  row.dataset.address = instance.address;
  row.dataset.role = instance.role;
  row.dataset.health = state;
  row.dataset.breaker = instance.breaker;
  row.dataset.pickable = String(instance.pickable);
  cell(row, 'address').textContent = instance.address;
  cell(row, 'source').textContent = instance.source;
  const healthCell = cell(row, 'health');
  healthCell.replaceChildren(badge(instance.state, state));
  healthCell.title = instance.load_problem ? `no load: ${instance.load_problem}` : '';
  const failures = instance.consecutive_failures;
  const breakerText = instance.breaker.replace('_', '-') + (failures ? ` (${failures} failed)` : '');
  cell(row, 'breaker').replaceChildren(
    badge(breakerText, instance.breaker === 'closed' ? 'healthy' : 'unhealthy'),
  );
  cell(row, 'in_flight').textContent = instance.in_flight;
  cell(row, 'picks').textContent = instance.picks;
  const load = instance.load;
  cell(row, 'load').textContent = load ? `${load.running} / ${load.waiting}` : '—';
  cell(row, 'kv').textContent = load ? `${load.kv_blocks_used} / ${load.kv_blocks_total}` : '—';
  const index = instance.index;
  const indexCell = cell(row, 'index');
  // Where its blocks come from now: its KV events (precise) or this router's own picks.
  const source = index && index.mode === 'precise' ? 'events' : 'routed';
  indexCell.textContent = index ? `${index.blocks} (${source})` : '—';
  indexCell.title = index
    ? `${index.mode}: events ${index.events_blocks}, routed ${index.routed_blocks}, pending ${index.pending_blocks} blocks of ${index.block_size} tokens`
    : 'no prefix index: the role\'s policy is not cache_aware';
  cell(row, 'action').querySelector('button').dataset.address = instance.address;
}

// ---------------------------------------------------------------------------- requests

function renderRequests(requests) {
  const body = document.querySelector('#requests tbody');
  document.getElementById('no-requests').hidden = requests.length > 0;
  const rows = new Map(Array.from(body.rows, (row) => [row.dataset.requestId, row]));
  requests.forEach((request, position) => {
    let row = rows.get(request.request_id);
    rows.delete(request.request_id);
    if (!row) {
      row = requestRow(request.request_id);
      fillRequest(row, request);
    }
    if (body.rows[position] !== row) body.insertBefore(row, body.rows[position] || null);
  });
  for (const gone of rows.values()) gone.remove();
  if (page.followNewest && requests.length) {
    const drawable = requests.find((r) => r.choices.some((c) => c.timeline_spans > 0));
    page.selected = (drawable || requests[0]).request_id;
  }
  for (const row of body.rows) {
    row.setAttribute('aria-selected', String(row.dataset.requestId === page.selected));
  }
  if (page.selected !== null && page.selected !== page.drawn) loadTimeline(page.selected);
}

function requestRow(requestId) {
  const row = el('tr');
  row.dataset.requestId = requestId;
  row.tabIndex = 0;
  for (const name of REQUEST_COLUMNS) {
    const c = el('td');
    c.dataset.col = name;
    if (['prompt', 'out', 'retries', 'ttft', 'total'].includes(name)) c.className = 'num';
    row.append(c);
  }
  return row;
}

function routeText(request) {
  const first = request.choices[0];
  if (!first) return '—';
  const route = first.prefill ? `${first.prefill} → ${first.decode}` : `${dash(first.decode)} alone`;
  const more = request.choices.length - 1;
  return more ? `${route} (+${more} choice${more > 1 ? 's' : ''})` : route;
}

function fillRequest(row, request) {
  const first = request.choices[0];
  // A stream that failed after its first bytes: its 200 went out before the error.
  const failed = request.status >= 400 || request.stream_failed;
  row.dataset.status = String(request.status);
  row.dataset.streamFailed = String(request.stream_failed);
  row.classList.toggle('failed', failed);
  const text = {
    arrived: new Date(request.arrived_unix_ms).toLocaleTimeString(),
    id: request.request_id,
    status: request.stream_failed ? `${request.status}, stream failed` : request.status,
    prompt: dash(request.prompt_tokens),
    out: request.completion_tokens,
    route: routeText(request),
    kv_stream: !first || first.kv_stream === null ? '—' : first.kv_stream ? 'yes' : 'no',
    retries: request.choices.reduce((sum, c) => sum + c.retries, 0),
    ttft: ms(first ? first.ttft_ms : null),
    total: ms(request.duration_ms),
    error: request.error || '',
  };
  for (const name of REQUEST_COLUMNS) cell(row, name).textContent = text[name];
  // The cell shows the message's start; the whole (at most 257 characters) on hover.
  cell(row, 'error').title = request.error || '';
}

function select(requestId) {
  page.followNewest = false;
  page.selected = requestId;
  for (const row of document.querySelectorAll('#requests tbody tr')) {
    row.setAttribute('aria-selected', String(row.dataset.requestId === requestId));
  }
  loadTimeline(requestId);
}

// ---------------------------------------------------------------------------- timeline

async function loadTimeline(requestId) {
  page.drawn = requestId;
  document.getElementById('timeline-id').textContent = requestId;
  const body = document.getElementById('timeline-body');
  let detail;
  try {
    const response = await fetch(`dashboard/requests/${encodeURIComponent(requestId)}`, {
      cache: 'no-store',
      credentials: 'omit',
    });
    const payload = await response.json();
    if (!response.ok) throw new Error(payload.error ? payload.error.message : `HTTP ${response.status}`);
    detail = payload;
  } catch (error) {
    if (page.selected === requestId) body.replaceChildren(el('p', error.message, 'muted'));
    return;
  }
  if (page.selected !== requestId) return; // another request was picked meanwhile
  const parts = [];
  if (detail.stream_failed) {
    parts.push(el('p', `The stream failed after its first bytes: ${detail.error}`, 'failure'));
  }
  if (!detail.choices.length) {
    const why = detail.stream_failed ? ' (no choice ended)' : detail.error ? `: ${detail.error}` : '';
    parts.push(el('p', `No timeline: the router answered ${detail.status}${why}`, 'muted'));
  } else if (!detail.timelines_kept) {
    parts.push(el('p', 'Timeline not kept: only the newest requests keep theirs.', 'muted'));
  }
  const width = Math.max(480, body.clientWidth - 8);
  for (const choice of detail.choices) {
    const route = choice.prefill ? `${choice.prefill} → ${choice.decode}` : `${choice.decode} alone`;
    const title = `choice ${choice.index} (${choice.request_id}): ${route}, TTFT ${ms(choice.ttft_ms)} ms, ` +
      `${choice.prompt_tokens} prompt tokens, ${choice.kv_blocks_received} KV blocks received`;
    const figure = el('figure', null, 'choice');
    figure.dataset.choice = String(choice.index);
    figure.append(el('figcaption', title));
    if (choice.timeline.length) figure.append(drawTimeline(choice, width));
    else if (detail.timelines_kept) figure.append(el('p', 'No spans recorded.', 'muted'));
    if (choice.timeline_rows_dropped && detail.timelines_kept) {
      figure.append(el('p', `${choice.timeline_rows_dropped} more spans not kept.`, 'muted'));
    }
    parts.push(figure);
  }
  body.replaceChildren(...parts);
}

function laneOf(name) {
  if (KV_SPANS.has(name)) return 'KV';
  return name.split('.')[0];
}

function niceStep(span) {
  const raw = span / 6;
  const power = 10 ** Math.floor(Math.log10(raw));
  for (const factor of [1, 2, 5, 10]) {
    if (raw <= factor * power) return factor * power;
  }
  return 10 * power;
}

function drawTimeline(choice, width) {
  const lanes = new Map();
  for (const row of choice.timeline) {
    const lane = laneOf(row.name);
    if (!lanes.has(lane)) lanes.set(lane, new Map());
    const names = lanes.get(lane);
    if (!names.has(row.name)) names.set(row.name, []);
    names.get(row.name).push(row);
  }
  const order = [...LANES.filter((l) => lanes.has(l)), ...[...lanes.keys()].filter((l) => !LANES.includes(l))];
  const end = Math.max(
    0.001,
    ...choice.timeline.map((r) => r.start_ms + r.duration_ms),
    choice.ttft_ms || 0,
  );
  const labelWidth = 210;
  const plotWidth = width - labelWidth - 20;
  const rowHeight = 16;
  const x = (t) => labelWidth + (t / end) * plotWidth;
  const root = svgEl('svg', { class: 'timeline', width, role: 'img' });
  root.append(svgEl('title'));
  root.firstChild.textContent = `timeline of ${choice.request_id}`;
  const axis = svgEl('g', { class: 'axis' });
  root.append(axis);
  let y = 22;
  for (const lane of order) {
    const group = svgEl('g', { class: 'lane' });
    group.dataset.lane = lane;
    const laneTitle = svgEl('text', { x: 4, y: y + 12, class: 'lane-title' });
    laneTitle.textContent = lane;
    group.append(laneTitle);
    for (const [name, spans] of lanes.get(lane)) {
      const label = svgEl('text', { x: labelWidth - 6, y: y + 12, 'text-anchor': 'end', class: 'span-label' });
      label.textContent = name.startsWith(`${lane}.`) ? name.slice(lane.length + 1) : name;
      group.append(label);
      spans.forEach((span, n) => {
        const bar = svgEl('rect', {
          x: x(span.start_ms).toFixed(2),
          y: y + 2,
          width: Math.max(1, (span.duration_ms / end) * plotWidth).toFixed(2),
          height: rowHeight - 4,
          class: n % 2 ? 'span alt' : 'span',
        });
        bar.dataset.name = name;
        const tip = svgEl('title');
        tip.textContent = `${name}: at ${ms(span.start_ms)} ms for ${ms(span.duration_ms)} ms`;
        bar.append(tip);
        group.append(bar);
      });
      y += rowHeight;
    }
    root.append(group);
    y += 8;
  }
  const step = niceStep(end);
  for (let t = 0; t <= end + 1e-9; t += step) {
    axis.append(svgEl('line', { x1: x(t), x2: x(t), y1: 16, y2: y, class: 'tick' }));
    const label = svgEl('text', { x: x(t), y: 12, 'text-anchor': 'middle' });
    label.textContent = `${+t.toFixed(3)} ms`;
    axis.append(label);
  }
  if (typeof choice.ttft_ms === 'number') {
    const marker = svgEl('g', { class: 'ttft' });
    marker.append(svgEl('line', { x1: x(choice.ttft_ms), x2: x(choice.ttft_ms), y1: 16, y2: y }));
    const label = svgEl('text', { x: x(choice.ttft_ms) + 4, y: y + 12 });
    label.textContent = `TTFT ${ms(choice.ttft_ms)} ms`;
    marker.append(label);
    root.append(marker);
    y += 16;
  }
  root.setAttribute('height', y + 4);
  root.setAttribute('viewBox', `0 0 ${width} ${y + 4}`);
  return root;
}

// ---------------------------------------------------------------------------- admin API

function token() {
  return document.getElementById('token').value.trim();
}

function remember(value) {
  try {
    if (value) sessionStorage.setItem(TOKEN_KEY, value);
    else sessionStorage.removeItem(TOKEN_KEY);
  } catch (error) {
    // Storage off (a private window's policy): the token lives in the field alone.
  }
}

function showResult(outcome, status, what, message) {
  const result = document.getElementById('admin-result');
  result.dataset.outcome = outcome;
  result.dataset.status = String(status);
  document.getElementById('admin-what').textContent = what;
  document.getElementById('admin-message').textContent = message;
}

async function adminCall(method, path, body, what) {
  const headers = {};
  const bearer = token();
  if (bearer) headers.Authorization = `Bearer ${bearer}`;
  if (body) headers['Content-Type'] = 'application/json';
  let response;
  let payload = null;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body ? JSON.stringify(body) : undefined,
      cache: 'no-store',
      credentials: 'omit',
    });
    payload = await response.json().catch(() => null);
  } catch (error) {
    showResult('error', 0, `${what}: failed: `, error.message);
    return;
  }
  if (response.ok) {
    const done = method === 'DELETE' ? 'removed' : `added, ${payload.state}`;
    showResult('ok', response.status, `${what}: `, done);
  } else {
    const message = payload && payload.error ? payload.error.message : response.statusText;
    const refused = response.status === 401 || response.status === 403;
    showResult(refused ? 'refused' : 'error', response.status, `${what}: refused (${response.status}): `, message);
  }
  poll();
}

// ---------------------------------------------------------------------------- wiring

function start() {
  const tokenInput = document.getElementById('token');
  try {
    tokenInput.value = sessionStorage.getItem(TOKEN_KEY) || '';
  } catch (error) {
    tokenInput.value = '';
  }
  tokenInput.addEventListener('input', () => remember(token()));
  document.getElementById('forget-token').addEventListener('click', () => {
    tokenInput.value = '';
    remember('');
  });
  document.getElementById('admin-form').addEventListener('submit', (event) => {
    event.preventDefault();
    const address = document.getElementById('add-address').value.trim();
    const role = document.getElementById('add-role').value;
    adminCall('POST', 'workers', { address, role }, `add ${address} as ${role}`);
  });
  document.getElementById('roles').addEventListener('click', (event) => {
    const button = event.target.closest('button[data-action="remove"]');
    if (!button) return;
    const address = button.dataset.address;
    adminCall('DELETE', `workers/${encodeURIComponent(address)}`, null, `remove ${address}`);
  });
  const requests = document.querySelector('#requests tbody');
  requests.addEventListener('click', (event) => {
    const row = event.target.closest('tr');
    if (row) select(row.dataset.requestId);
  });
  requests.addEventListener('keydown', (event) => {
    const row = event.target.closest('tr');
    if (row && (event.key === 'Enter' || event.key === ' ')) {
      event.preventDefault();
      select(row.dataset.requestId);
    }
  });
  for (const role of ROLES) roleSection(role);
  poll();
}

start();
