/*
 * The lab extension's request paths and tick labels, run in Node (tests/test_extension_node.py).
 *
 *   node extension_node.js build SRC OUT    transpile SRC/*.ts (TypeScript's transpileModule, no
 *                                           type check: the build does that) into OUT/src, with
 *                                           stand-ins for @jupyterlab/services and coreutils
 *   node extension_node.js run OUT SCENARIO prints the scenario's facts as JSON
 *
 * The stand-ins are the browser's edges, nothing of the extension: fetch answers as a scenario
 * says (a refused connection is ServerConnection.NetworkError, as JupyterLab's makeRequest
 * makes it), a WebSocket that a scenario opens and closes, and a virtual clock under setTimeout
 * so that @lumino/polling's real Poll backs off in virtual seconds. Promise rejections nobody
 * handled are counted (a browser reports each as an uncaught error).
 */
'use strict';
const fs = require('fs');
const path = require('path');

const EXT = path.resolve(__dirname, '..', 'extension');

function build(src, out) {
  const ts = require(path.join(EXT, 'node_modules', 'typescript'));
  fs.mkdirSync(path.join(out, 'src'), { recursive: true });
  for (const f of fs.readdirSync(src).filter(f => f.endsWith('.ts'))) {
    const js = ts.transpileModule(fs.readFileSync(path.join(src, f), 'utf8'), {
      compilerOptions: {
        module: ts.ModuleKind.CommonJS,
        target: ts.ScriptTarget.ES2020,
        esModuleInterop: true
      }
    }).outputText;
    fs.writeFileSync(path.join(out, 'src', f.replace(/\.ts$/, '.js')), js);
  }
  const stub = (name, text) => {
    const dir = path.join(out, 'node_modules', '@jupyterlab', name);
    fs.mkdirSync(dir, { recursive: true });
    fs.writeFileSync(path.join(dir, 'index.js'), text);
  };
  stub(
    'services',
    `
class NetworkError extends TypeError {
  constructor(original) { super(original ? original.message : 'network error'); }
}
class ResponseError extends Error {
  constructor(response, message) { super(message || 'status ' + response.status); this.response = response; }
}
exports.ServerConnection = {
  makeSettings: () => ({ baseUrl: 'http://lab/', wsUrl: 'ws://lab/', token: '', appendToken: false }),
  makeRequest: (url, init) => globalThis.__fetch(url, init || {}),
  NetworkError,
  ResponseError
};`
  );
  stub(
    'coreutils',
    `
exports.URLExt = { join: (...parts) => parts.map((p, i) => i ? p.replace(/^\\/+/, '') : p.replace(/\\/+$/, '')).join('/') };`
  );
}

// --- the browser's edges ------------------------------------------------------------------------
const realImmediate = setImmediate;
const flush = async () => {
  for (let i = 0; i < 5; i++) {
    await new Promise(r => realImmediate(r));
  }
};

/** setTimeout on a virtual clock: `advance(ms)` runs what falls due, in order. */
function installClock() {
  let now = 0;
  let nextId = 1;
  const timers = new Map();
  globalThis.setTimeout = (fn, ms = 0, ...args) => {
    const id = nextId++;
    timers.set(id, { at: now + Math.max(0, Number(ms) || 0), fn: () => fn(...args) });
    return id;
  };
  globalThis.clearTimeout = id => timers.delete(id);
  globalThis.setInterval = (fn, ms = 0, ...args) => {
    const id = nextId++;
    const every = Math.max(1, Number(ms) || 0);
    const tick = () => {
      timers.set(id, { at: now + every, fn: tick });
      fn(...args);
    };
    timers.set(id, { at: now + every, fn: tick });
    return id;
  };
  globalThis.clearInterval = id => timers.delete(id);
  const clock = {
    get now() {
      return now;
    },
    /** Advance until `promise` settles (at most `limit` ms); its value, or throws its error. */
    async settle(promise, limit = 120000) {
      let done = false;
      promise.then(
        () => (done = true),
        () => (done = true)
      );
      for (let t = 0; t < limit && !done; t += 100) {
        await clock.advance(100);
      }
      if (!done) {
        throw new Error(`still pending after ${limit} virtual ms`);
      }
      return promise;
    },
    async advance(ms) {
      const end = now + ms;
      await flush();
      for (;;) {
        let due = null;
        for (const [id, t] of timers) {
          if (t.at <= end && (due === null || t.at < timers.get(due).at)) {
            due = id;
          }
        }
        if (due === null) {
          break;
        }
        const t = timers.get(due);
        timers.delete(due);
        now = Math.max(now, t.at);
        t.fn();
        await flush();
      }
      now = end;
      await flush();
    }
  };
  return clock;
}

/** A websocket whose server accepts it (while FakeSocket.up) or refuses it, 5 ms later. */
class FakeSocket {
  constructor(url) {
    this.url = url;
    this.readyState = 0;
    this.sent = [];
    FakeSocket.all.push(this);
    setTimeout(() => (FakeSocket.up ? this.open() : this.drop()), 5);
  }
  send(text) {
    this.sent.push(JSON.parse(text));
  }
  close() {
    this.drop(1000);
  }
  // what the server does
  open() {
    this.readyState = 1;
    this.openedAt = FakeSocket.clock.now;
    this.onopen && this.onopen({});
  }
  push(msg) {
    this.onmessage && this.onmessage({ data: JSON.stringify(msg) });
  }
  drop(code = 1006) {
    if (this.readyState === 3) {
      return;
    }
    this.readyState = 3;
    this.onclose && this.onclose({ code });
  }
}
FakeSocket.all = [];
FakeSocket.up = true;
FakeSocket.OPEN = 1;

let services;
/** What fetch answers: a JSON body, a refused connection, a body cut mid-way, an HTTP error. */
const reply = {
  json: (body, status = 200) =>
    new Response(JSON.stringify(body), { status, headers: { 'Content-Type': 'application/json' } }),
  refused: () => {
    throw new services.ServerConnection.NetworkError(new TypeError('Failed to fetch'));
  },
  cut: () =>
    new Response(
      new ReadableStream({
        start(c) {
          c.enqueue(new TextEncoder().encode('{"runs": ['));
          c.error(new TypeError('network error'));
        }
      }),
      { status: 200 }
    )
};

function setup(out) {
  // @lumino/* from the extension's own node_modules (the stand-ins are in OUT/node_modules)
  process.env.NODE_PATH = path.join(EXT, 'node_modules');
  require('module').Module._initPaths();
  const clock = installClock();
  FakeSocket.clock = clock;
  globalThis.window = globalThis;
  globalThis.WebSocket = FakeSocket;
  const unhandled = [];
  process.on('unhandledRejection', e => unhandled.push(String((e && e.message) || e)));
  const warnings = [];
  console.warn = (...args) => warnings.push(args.map(String).join(' '));
  services = require(path.join(out, 'node_modules', '@jupyterlab', 'services'));
  const requests = [];
  const times = [];
  let server = () => reply.refused();
  globalThis.__fetch = async (url, init) => {
    const p = url.replace('http://lab/gpu-lab/', '');
    requests.push(p);
    times.push(clock.now);
    return server(p, init);
  };
  /** ms from `t` to the first request for `prefix` made at or after it (null: none) */
  const firstAfter = (prefix, t) => {
    const i = requests.findIndex((p, j) => times[j] >= t && p.startsWith(prefix));
    return i < 0 ? null : times[i] - t;
  };
  return {
    clock,
    unhandled,
    warnings,
    requests,
    firstAfter,
    serve: fn => (server = fn),
    load: name => require(path.join(out, 'src', name))
  };
}

const loss = (seq, step) => ({
  seq,
  rank: 0,
  kind: 'metric',
  t: 1000 + step,
  step,
  data: { loss: 1 / (step + 1) }
});
const runRow = (status, extra = {}) => ({
  id: 'r1',
  name: 'r1',
  status,
  num_processes: 1,
  started: 1000,
  ended: null,
  last_step: null,
  last_loss: null,
  error: null,
  notebook: null,
  ...extra
});
const detail = (status, steps, extra = {}) => ({
  ...runRow(status),
  config: {},
  seq: steps,
  notes: [],
  failure: null,
  logs: [],
  series: {
    loss: {
      0: {
        step: [...Array(steps).keys()],
        t: [...Array(steps).keys()].map(s => 1000 + s),
        value: [...Array(steps).keys()].map(s => 1 / (s + 1))
      }
    }
  },
  ...extra
});
const stepsOf = view => [...(view.metrics.get('loss')?.get('0')?.steps ?? [])];

// --- scenarios ----------------------------------------------------------------------------------
const SCENARIOS = {
  /** requestAPI: a body cut after the headers, a refused connection, a server's refusal. */
  async requests(env) {
    const { requestAPI } = env.load('model.js');
    const { ServerConnection } = services;
    const seen = {};
    for (const [name, answer] of [
      ['cut', () => reply.cut()],
      ['refused', () => reply.refused()],
      ['refusal', () => reply.json({ message: 'no run with id x' }, 404)]
    ]) {
      env.serve(answer);
      try {
        await requestAPI('api/runs');
        seen[name] = 'resolved';
      } catch (e) {
        seen[name] = {
          network: e instanceof ServerConnection.NetworkError,
          response: e instanceof ServerConnection.ResponseError,
          message: e.message
        };
      }
    }
    return { seen, unhandled: env.unhandled };
  },

  /** A run view whose run fails while the server cannot be reached: the triage is read when it
   *  can be, and nothing is left unhandled. */
  async triage(env) {
    const { GpuLabModel } = env.load('model.js');
    const { RunViewModel } = env.load('runmodel.js');
    let triageTries = 0;
    env.serve(p => {
      if (p === 'api/runs/r1?points=4') {
        return ++triageTries <= 2
          ? reply.refused()
          : reply.json(
              detail('failed', 3, {
                failure: { text: 'rank 0: ValueError: boom', category: 'user code', ranks: [] }
              })
            );
      }
      if (p.startsWith('api/runs/r1?')) return reply.json(detail('running', 3));
      if (p.startsWith('api/telemetry')) return reply.json({ latest: null, history: [] });
      if (p === 'api/runs') return reply.json({ runs: [runRow('running')] });
      return reply.json({ message: 'unknown ' + p }, 404);
    });
    const lab = new GpuLabModel();
    lab.start();
    await env.clock.advance(10);
    const view = new RunViewModel(lab, 'r1');
    await env.clock.settle(view.open());
    FakeSocket.all[0].push({ type: 'run', run: 'r1', row: runRow('failed', { ended: 1010 }) });
    const after = {};
    for (const s of [0, 1, 5, 30]) {
      await env.clock.advance(s * 1000);
      after[s] = view.failure ? view.failure.text : null;
    }
    view.dispose();
    lab.dispose();
    return { after, triageTries, unhandled: env.unhandled };
  },

  /** Opening a run view while the server is away: it retries until the run loads; a run the
   *  server does not know is refused at once. */
  async open(env) {
    const { GpuLabModel } = env.load('model.js');
    const { RunViewModel } = env.load('runmodel.js');
    let up = false;
    env.serve(p => {
      if (!up) return reply.refused();
      if (p.startsWith('api/runs/r1?')) return reply.json(detail('running', 3));
      if (p.startsWith('api/runs/nope?'))
        return reply.json({ message: 'no run with id nope' }, 404);
      if (p.startsWith('api/runs/r1/events'))
        return reply.json({ run: runRow('running'), events: [], seq: 3, more: false });
      if (p.startsWith('api/telemetry')) return reply.json({ latest: null, history: [] });
      return reply.json({ runs: [] });
    });
    const lab = new GpuLabModel();
    const view = new RunViewModel(lab, 'r1');
    const feeds = [];
    view.changed.connect((_, c) => c === 'feed' && feeds.push(view.feed));
    let opened = null;
    view.open().then(
      () => (opened = 'opened'),
      e => (opened = 'rejected: ' + e.message)
    );
    await env.clock.advance(8000);
    const whileDown = {
      opened,
      tries: env.requests.filter(p => p.startsWith('api/runs/r1?')).length,
      feed: view.feed
    };
    up = true;
    await env.clock.advance(31000);
    const refused = new RunViewModel(lab, 'nope');
    let refusal = null;
    refused.open().then(
      () => (refusal = 'opened'),
      e => (refusal = e.message)
    );
    await env.clock.advance(31000);
    const nopeTries = env.requests.filter(p => p.startsWith('api/runs/nope?')).length;
    view.dispose();
    refused.dispose();
    lab.dispose();
    return {
      whileDown,
      opened,
      steps: stepsOf(view),
      feeds,
      refusal,
      nopeTries,
      unhandled: env.unhandled
    };
  },

  /** The lab's socket closes while a run view follows a run: the view polls (backing off while
   *  that fails too), the socket reopens and follows the run again from where the view stands;
   *  the runs list comes back at once; every step is held once. */
  async socket(env) {
    const { GpuLabModel } = env.load('model.js');
    const { RunViewModel } = env.load('runmodel.js');
    let seq = 3; // the run's record: a step per event
    const events = after =>
      [...Array(Math.max(0, Math.min(seq, after + 4) - after)).keys()].map(i =>
        loss(after + i + 1, after + i)
      );
    let up = true;
    env.serve(p => {
      if (!up) return reply.refused();
      if (p.startsWith('api/runs/r1/events')) {
        const after = Number(p.split('after=')[1]);
        const page = events(after);
        return reply.json({
          run: runRow('running'),
          events: page,
          seq: after + page.length,
          more: after + page.length < seq
        });
      }
      if (p.startsWith('api/runs/r1/logs'))
        return reply.json({ file: 'rank0.log', from: 0, to: 0, text: '' });
      if (p.startsWith('api/runs/r1?')) return reply.json(detail('running', 3));
      if (p.startsWith('api/telemetry')) return reply.json({ latest: null, history: [] });
      return reply.json({ runs: [runRow('running', { last_step: seq - 1 })] });
    });
    const lab = new GpuLabModel();
    const states = [];
    lab.stateChanged.connect((_, s) => states.push(s));
    lab.start();
    await env.clock.advance(10);
    const view = new RunViewModel(lab, 'r1');
    const feeds = [];
    view.changed.connect((_, c) => c === 'feed' && feeds.push(view.feed));
    await env.clock.settle(view.open());
    // pushed live: steps 3..4
    seq = 5;
    FakeSocket.all[0].push({ type: 'run', run: 'r1', events: [loss(4, 3), loss(5, 4)] });
    // the server goes away: the socket drops, requests and new sockets are refused
    up = false;
    FakeSocket.up = false;
    FakeSocket.all[0].drop();
    seq = 9; // the run goes on reporting
    await env.clock.advance(10000);
    const down = {
      feed: view.feed,
      state: lab.state,
      steps: stepsOf(view).length,
      sockets: FakeSocket.all.length
    };
    // back: the REST poll catches up (backing off, so within its longest wait) ...
    up = true;
    seq = 12;
    await env.clock.advance(31000);
    const polled = { feed: view.feed, steps: stepsOf(view) };
    // ... and the socket reopens (at most 10 s apart) and follows from where the view stands
    const before = FakeSocket.all.length;
    FakeSocket.up = true;
    await env.clock.advance(11000);
    const reopened = FakeSocket.all.slice(before);
    const refollow = reopened.map(s => s.sent.filter(m => m.follow)).flat();
    const lastOpen = reopened[reopened.length - 1].openedAt;
    seq = 14;
    reopened[reopened.length - 1].push({
      type: 'run',
      run: 'r1',
      events: [loss(13, 12), loss(14, 13)]
    });
    await env.clock.advance(10);
    const live = { feed: view.feed, state: lab.state, steps: stepsOf(view) };
    // once live again, the view no longer polls
    const polls = env.requests.filter(p => p.includes('/events')).length;
    await env.clock.advance(20000);
    const pollsAfter = env.requests.filter(p => p.includes('/events')).length;
    const firstFollow = FakeSocket.all[0].sent.filter(m => m.follow);
    view.dispose();
    lab.dispose();
    return {
      down,
      polled,
      refollow,
      live,
      states,
      feeds,
      firstFollow,
      pollsLive: pollsAfter - polls,
      unhandled: env.unhandled
    };
  },

  /** The runs list while the server is away for a minute: the panel's state says so, and when
   *  the lab's socket is back the list is fetched at once, not after the poll's backoff. */
  async runs(env) {
    const { GpuLabModel } = env.load('model.js');
    let up = true;
    env.serve(() => (up ? reply.json({ runs: [runRow('running')] }) : reply.refused()));
    const lab = new GpuLabModel();
    const states = [];
    lab.stateChanged.connect((_, s) => states.push(s));
    lab.start();
    await env.clock.advance(3000);
    const live = { state: lab.state, runs: lab.runs.length };
    up = false;
    FakeSocket.up = false;
    FakeSocket.all[0].drop();
    await env.clock.advance(60000);
    const down = { state: lab.state, reason: lab.stateReason };
    up = true;
    FakeSocket.up = true;
    await env.clock.advance(11000);
    const opened = FakeSocket.all[FakeSocket.all.length - 1].openedAt;
    const back = { state: lab.state, runsAfterOpen: env.firstAfter('api/runs', opened) };
    lab.dispose();
    return { live, down, back, states, unhandled: env.unhandled };
  },

  /** A live comparison whose fetches fail for a while: it retries, says so, and goes on; it
   *  fetches at once when the lab's socket is back, and stops once every run has ended. */
  async compare(env) {
    const { GpuLabModel } = env.load('model.js');
    const { CompareModel } = env.load('comparemodel.js');
    let up = true;
    let status = 'running';
    env.serve(p => {
      if (p.startsWith('api/compare')) {
        if (!up) return reply.refused();
        return reply.json({
          runs: [
            { ...runRow(status), label: 'a', differs: {} },
            { ...runRow('succeeded', { id: 'r2' }), label: 'b', differs: {} }
          ],
          differ: [],
          metrics: {}
        });
      }
      return reply.json({ runs: [] });
    });
    const lab = new GpuLabModel();
    const cmp = new CompareModel(lab, ['r1', 'r2']);
    const states = [];
    cmp.changed.connect(() => states[states.length - 1] !== cmp.state && states.push(cmp.state));
    const fetches = () => env.requests.filter(p => p.startsWith('api/compare')).length;
    cmp.refresh();
    await env.clock.advance(12000);
    const live = fetches();
    up = false;
    await env.clock.advance(40000);
    const down = { state: cmp.state, error: cmp.error, fetches: fetches() - live };
    up = true;
    await env.clock.advance(31000);
    const back = { state: cmp.state, fetches: fetches() };
    // the lab's socket coming back fetches at once
    lab.start();
    await env.clock.advance(10);
    FakeSocket.up = false;
    FakeSocket.all[0].drop();
    await env.clock.advance(3000);
    FakeSocket.up = true;
    await env.clock.advance(11000);
    const opened = FakeSocket.all[FakeSocket.all.length - 1].openedAt;
    const atOnce = env.firstAfter('api/compare', opened);
    status = 'succeeded';
    await env.clock.advance(6000);
    const ended = { state: cmp.state, fetches: fetches() };
    await env.clock.advance(60000);
    cmp.dispose();
    lab.dispose();
    return {
      live,
      down,
      back,
      atOnce,
      ended,
      endedFetches: fetches() - ended.fetches,
      states,
      unhandled: env.unhandled
    };
  },

  /** Tick labels (ticks.ts) of the ticks uPlot would place for each case read from stdin:
   *  {splits, incr} as given, or {min, max, dim} of a series drawn `dim` px long. */
  async ticks(env) {
    const { numberTicks, clockTicks } = env.load('ticks.js');
    delete globalThis.window; // uPlot, loaded for its ranges, reads the DOM where there is a window
    const cases = JSON.parse(fs.readFileSync(0, 'utf8'));
    return cases.map(c => {
      const { splits, incr } = c.splits ? c : uplotSplits(c);
      return {
        splits,
        incr,
        labels: c.time ? clockTicks(splits, incr) : numberTicks(splits, incr)
      };
    });
  }
};

// --- where uPlot puts ticks (uPlot 1.6: snapNumY's range, findIncr, numAxisSplits) ------------
const MULTS = [1, 2, 2.5, 5];
const decimalsOf = v => {
  for (let d = 0; d < 20; d++) {
    if (Math.abs(v * 10 ** d - Math.round(v * 10 ** d)) < 1e-9 * v * 10 ** d) return d;
  }
  return 20;
};
const NUM_INCRS = [];
for (let e = -16; e <= 16; e++) MULTS.forEach(m => NUM_INCRS.push(+(m * 10 ** e).toPrecision(3)));
const TIME_INCRS = [
  0.001,
  0.002,
  0.0025,
  0.005,
  0.01,
  0.02,
  0.025,
  0.05,
  0.1,
  0.2,
  0.25,
  0.5,
  1,
  5,
  10,
  15,
  30,
  60,
  300,
  600,
  900,
  1800,
  3600,
  7200,
  10800,
  14400,
  21600,
  28800,
  43200,
  86400,
  2 * 86400,
  3 * 86400,
  7 * 86400
];

function uplotSplits({ min, max, time, dim }) {
  const uPlot = require(path.join(EXT, 'node_modules', 'uplot'));
  // the y axis pads its range (snapNumY); the x axis is the data's (snapNumX)
  const [lo, hi] = time ? [min, max] : uPlot.rangeNum(min, max, 0.1, true);
  const space = time ? 50 : 30;
  const delta = hi - lo;
  const incr = (time ? TIME_INCRS : NUM_INCRS).find(i => (dim * i) / delta >= space);
  const dec = decimalsOf(incr);
  const splits = [];
  for (let k = Math.ceil(lo / incr - 1e-6); k * incr <= hi + 1e-6 * incr; k++) {
    splits.push(+(k * incr).toFixed(Math.min(20, dec)));
  }
  return { splits, incr };
}

async function main() {
  const [cmd, a, b] = process.argv.slice(2);
  if (cmd === 'build') {
    build(path.resolve(a), path.resolve(b));
    return;
  }
  const env = setup(path.resolve(a));
  // a scenario that waits on a timer nobody advances ends the loop: that is a failure
  process.exitCode = 3;
  const facts = await SCENARIOS[b](env);
  process.stdout.write(JSON.stringify(facts), () => process.exit(0));
}

main().catch(e => {
  process.stderr.write(String((e && e.stack) || e));
  process.exit(1);
});
