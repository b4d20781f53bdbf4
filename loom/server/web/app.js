// Loom's page: a dashboard of the server's figures (GET /stats, every second) and a chat
// playground (POST /v1/chat/completions, streamed). Every request carries the API key typed
// into the page, kept for this tab's session only (sessionStorage). Text from the server is
// set as text, never as markup.
"use strict";

const KEY = "loom-api-key";
const HISTORY = 120; // seconds of tokens a second on the chart
const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], messages: [], controller: null, needKey: false };

function headers(extra = {}) {
  const key = sessionStorage.getItem(KEY);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

async function call(path, init = {}) {
  const response = await fetch(path, { ...init, headers: headers(init.headers) });
  if (response.status === 401) {
    state.needKey = true;
    notice("This server needs an API key: type it above.");
    throw new Error("an API key is needed");
  }
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error.message;
    } catch (_) {
      // not OpenAI's error shape: the status says it
    }
    throw new Error(message);
  }
  return response;
}

// The dashboard

function number(value, digits = 0) {
  return Number(value).toLocaleString("en", { maximumFractionDigits: digits });
}

function show(stats) {
  $("state").textContent = stats.state;
  $("viewer").textContent = stats.admin ? "every tenant's" : "your tenant's";
  $("running").textContent = number(stats.num_running);
  $("waiting").textContent = number(stats.num_waiting);
  $("paused").textContent = number(stats.num_paused);
  $("throughput").textContent = number(stats.gen_throughput, 1);
  const used = stats.num_total_blocks - stats.num_free_blocks;
  $("blocks-used").textContent = `${number(used)} / ${number(stats.num_total_blocks)}`;
  $("blocks-cached").textContent = number(stats.num_cached_blocks);
  const rate = stats.prefix_cache_hits / Math.max(stats.prefix_cache_queries, 1);
  $("hit-rate").textContent = `${number(100 * rate, 1)}%`;
  $("generated").textContent = number(stats.num_generated_tokens);
  state.history.push(stats.gen_throughput);
  state.history = state.history.slice(-HISTORY);
  const top = Math.max(1, ...state.history);
  const points = state.history.map(
    (v, i) => `${(600 * i) / (HISTORY - 1)},${100 - (96 * v) / top}`,
  );
  $("line").setAttribute("points", points.join(" "));
  const body = $("tenants").tBodies[0];
  body.replaceChildren();
  for (const [name, t] of Object.entries(stats.tenants)) {
    const row = body.insertRow();
    const cells = [name || "(shared)", t.weight, t.num_prompt_tokens, t.num_generated_tokens];
    for (const value of [...cells, t.num_cached_tokens, t.num_refused]) {
      row.insertCell().textContent = typeof value === "number" ? number(value, 2) : value;
    }
  }
}

async function refresh() {
  try {
    show(await (await call("/stats")).json());
    if (!state.needKey) notice("");
    if (state.model === null) {
      const models = await (await call("/v1/models")).json();
      state.model = models.data[0].id;
      $("model").textContent = state.model;
    }
  } catch (error) {
    if (!state.needKey) notice(`The server did not answer: ${error.message}`);
  }
}

async function poll() {
  // One request at a time, a second after the last answer; none while the tab is hidden or
  // a key is wanted (typing one polls again).
  if (!document.hidden && !state.needKey) await refresh();
  setTimeout(poll, 1000);
}

// The playground

function turn(role, text) {
  const div = document.createElement("div");
  div.className = `turn ${role}`;
  div.textContent = text;
  $("conversation").append(div);
  return div;
}

function request() {
  const body = {
    model: state.model,
    messages: state.messages,
    stream: true,
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "playground", schema: JSON.parse(schema) },
    };
  }
  return body;
}

async function stream(response, answer) {
  // Server-sent events: `data: {chunk}` blocks, then `data: [DONE]`.
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const thought = document.createElement("span");
  thought.className = "reasoning";
  const said = document.createTextNode("");
  answer.replaceChildren(thought, said);
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    pending += decoder.decode(value, { stream: true });
    const events = pending.split("\n\n");
    pending = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "");
      if (data === "[DONE]") return said.data;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices.length ? chunk.choices[0].delta : {};
      thought.textContent += delta.reasoning_content || "";
      said.data += delta.content || "";
    }
  }
  return said.data;
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value;
  if (!text.trim() || state.controller) return;
  state.messages.push({ role: "user", content: text });
  turn("user", text);
  $("prompt").value = "";
  const answer = turn("assistant", "");
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  try {
    const response = await call("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(request()),
      signal: state.controller.signal,
    });
    state.messages.push({ role: "assistant", content: await stream(response, answer) });
  } catch (error) {
    state.messages.pop();
    answer.classList.add("error");
    answer.textContent = error.name === "AbortError" ? "(stopped)" : error.message;
  } finally {
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function tab(name) {
  for (const other of ["dashboard", "playground"]) {
    $(other).hidden = other !== name;
    $(`tab-${other}`).classList.toggle("active", other === name);
  }
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY, $("key").value);
  $("key").value = "";
  state.needKey = false;
  notice("");
  refresh();
}

$("tab-dashboard").addEventListener("click", () => tab("dashboard"));
$("tab-playground").addEventListener("click", () => tab("playground"));
$("key-form").addEventListener("submit", useKey);
$("chat-form").addEventListener("submit", send);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", () => {
  state.messages = [];
  $("conversation").replaceChildren();
});
poll();
