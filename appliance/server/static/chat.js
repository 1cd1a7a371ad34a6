// The chat page: it renders a conversation and calls the appliance's OpenAI API like any
// other client (GET /v1/models, POST /v1/chat/completions streamed). No other logic.
"use strict";

const $ = (id) => document.getElementById(id);

const page = {
  conversation: [], // the {role, content} turns sent with each request (no system prompt)
  controller: null, // the AbortController of the answer streaming now, if any
  model: null, // the served model's id, from /v1/models
};

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `${response.status} ${response.statusText}`;
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: authHeaders() });
  if (!response.ok) {
    page.model = null;
    const why = response.status === 401 ? "enter the API key" : await errorMessage(response);
    $("model").textContent = `model: unknown (${why})`;
    return;
  }
  const body = await response.json();
  page.model = body.data[0]?.id ?? null;
  $("model").textContent = `model: ${page.model}`;
}

function addMessage(role, text) {
  const item = document.createElement("li");
  item.className = role;
  const who = document.createElement("p");
  who.className = "role";
  who.textContent = role;
  const content = document.createElement("p");
  content.className = "content";
  content.textContent = text; // text, never HTML: a model's output is not markup
  item.append(who, content);
  $("log").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

// Server-sent events' data fields, as they arrive: events end at a blank line; a data
// field may span lines; comments and other fields are skipped.
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split(/\r\n\r\n|\n\n|\r\r/);
    buffer = events.pop();
    for (const event of events) {
      const data = event
        .split(/\r\n|\n|\r/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

function requestBody() {
  const system = $("system").value.trim();
  const messages = system ? [{ role: "system", content: system }] : [];
  return {
    model: page.model ?? "",
    messages: messages.concat(page.conversation),
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    max_tokens: Number($("max-tokens").value),
  };
}

// "42 tokens · 18.3 tokens/s · first token after 0.21 s · stopped": the rate is over the
// tokens after the first, the decode speed; the count is the server's (usage) unless the
// stream ended before it came (stopped), then the pieces received.
function describe(answer) {
  const parts = [];
  const tokens = answer.usage?.completion_tokens ?? answer.pieces;
  if (tokens) parts.push(`${tokens} tokens${answer.usage ? "" : " received"}`);
  const seconds = (answer.end - answer.first) / 1000;
  if (answer.first !== null && tokens > 1 && seconds > 0) {
    parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
  }
  if (answer.first !== null) {
    parts.push(`first token after ${((answer.first - answer.start) / 1000).toFixed(2)} s`);
  }
  if (answer.ended) parts.push(answer.ended);
  return parts.join(" · ");
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("status").textContent = busy ? "answering… (Stop or Escape ends it)" : "";
}

async function stream(answer, content, signal) {
  if (!page.model) await loadModel();
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders() },
    body: JSON.stringify(requestBody()),
    signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  for await (const data of sseData(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.usage) answer.usage = chunk.usage;
    const choice = chunk.choices?.[0];
    const piece = choice?.delta?.content;
    if (piece) {
      answer.first ??= performance.now();
      answer.pieces += 1;
      answer.text += piece;
      content.textContent = answer.text;
    }
    if (choice?.finish_reason === "length") answer.ended = "cut at max tokens";
  }
}

async function send(text) {
  page.conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const item = addMessage("assistant", "");
  const stats = document.createElement("p");
  stats.className = "stats";
  item.append(stats);
  // Busy while it streams: a screen reader reads the answer once, not every token.
  item.setAttribute("aria-busy", "true");
  const answer = { text: "", pieces: 0, usage: null, start: performance.now(), first: null };
  answer.ended = "";
  page.controller = new AbortController();
  setBusy(true);
  try {
    await stream(answer, item.querySelector(".content"), page.controller.signal);
  } catch (error) {
    if (error.name === "AbortError") {
      answer.ended = "stopped";
    } else {
      answer.ended = `error: ${error.message}`;
      item.classList.add("error");
    }
  }
  answer.end = performance.now();
  page.controller = null;
  if (answer.text) {
    page.conversation.push({ role: "assistant", content: answer.text });
  } else {
    page.conversation.pop(); // nothing came back: the question can be sent again
    if (!$("prompt").value) $("prompt").value = text;
  }
  stats.textContent = describe(answer);
  item.setAttribute("aria-busy", "false");
  setBusy(false);
  $("prompt").focus();
}

function stop() {
  page.controller?.abort();
}

function setUp() {
  const saved = sessionStorage.getItem("appliance-api-key");
  if (saved) $("api-key").value = saved;
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("appliance-api-key", $("api-key").value.trim());
    loadModel();
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || page.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    // Enter sends, Shift+Enter is a newline; not while an input method composes a word.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (event) => {
    if (event.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("clear").addEventListener("click", () => {
    stop();
    page.conversation = [];
    $("log").replaceChildren();
    $("prompt").focus();
  });
  loadModel();
  $("prompt").focus();
}

setUp();
