// The chat page: conversations kept in localStorage, replies streamed from /v1/chat/completions (SSE),
// Stop aborts the fetch (the server cancels the request), markdown rendered by LI.renderMarkdown; the
// JSON schema / tools panel adds response_format and tools, streamed tool calls shown as blocks.
"use strict";
(function () {
  const STORE = "localinfer.chats", SETTINGS = "localinfer.settings";
  const $ = (id) => document.getElementById(id);
  let model = null, controller = null, data = load();

  function load() {
    try {
      const d = JSON.parse(localStorage.getItem(STORE));
      if (d && Array.isArray(d.chats)) return d;
    } catch (e) { /* a damaged store starts over */ }
    return { current: null, chats: [] };
  }
  function save() { localStorage.setItem(STORE, JSON.stringify(data)); }
  function current() {
    let chat = data.chats.find((c) => c.id === data.current);
    if (!chat) chat = newChat();
    return chat;
  }
  function newChat() {
    const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6), title: "New chat",
                   system: $("system").value, messages: [] };
    data.chats.unshift(chat);
    data.current = chat.id;
    save();
    return chat;
  }

  // ---- settings ----------------------------------------------------------------
  const FIELDS = ["temperature", "top_p", "max_tokens", "seed", "schema", "tools", "tool_choice"];
  function loadSettings() {
    let s = {};
    try { s = JSON.parse(localStorage.getItem(SETTINGS)) || {}; } catch (e) { s = {}; }
    for (const f of FIELDS) if (s[f] !== undefined) $(f).value = s[f];
    for (const f of FIELDS) $(f).addEventListener("change", saveSettings);
    if (s.parallel_tools !== undefined) $("parallel_tools").checked = s.parallel_tools;
    $("parallel_tools").addEventListener("change", saveSettings);
    for (const f of ["schema", "tools"]) $(f).addEventListener("input", () => { structured(); saveSettings(); });
    if ($("schema").value.trim() || $("tools").value.trim()) $("structured").open = true;
    structured();
  }
  function saveSettings() {
    const s = {};
    for (const f of FIELDS) s[f] = $(f).value;
    s.parallel_tools = $("parallel_tools").checked;
    localStorage.setItem(SETTINGS, JSON.stringify(s));
  }
  function sampling() {
    const out = {};
    const t = parseFloat($("temperature").value), p = parseFloat($("top_p").value);
    const n = parseInt($("max_tokens").value, 10), seed = parseInt($("seed").value, 10);
    if (!Number.isNaN(t)) out.temperature = t;
    if (!Number.isNaN(p)) out.top_p = p;
    if (!Number.isNaN(n)) out.max_completion_tokens = n;
    if (!Number.isNaN(seed)) out.seed = seed;
    return out;
  }
  // The panel's fields as request fields, or null (each bad field's error shown under it).
  function structured() {
    const out = {};
    let ok = true;
    const parse = (id, check, what) => {
      const text = $(id).value.trim();
      $(id + "_error").textContent = "";
      if (!text) return undefined;
      try {
        const v = JSON.parse(text);
        if (check(v)) return v;
        $(id + "_error").textContent = "not " + what;
      } catch (e) {
        $(id + "_error").textContent = "not valid JSON: " + e.message;
      }
      ok = false;
      return undefined;
    };
    const schema = parse("schema", (v) => v !== null && typeof v === "object" && !Array.isArray(v),
                         "a JSON object (a JSON schema)");
    const tools = parse("tools", Array.isArray, "a JSON array of tools");
    if (schema !== undefined)
      out.response_format = { type: "json_schema", json_schema: { name: "schema", schema, strict: true } };
    if (tools !== undefined && tools.length) { out.tools = tools; out.tool_choice = $("tool_choice").value;
      out.parallel_tool_calls = $("parallel_tools").checked; }
    return ok ? out : null;
  }

  // ---- drawing -----------------------------------------------------------------
  function drawList() {
    const ul = $("chats");
    ul.replaceChildren();
    for (const chat of data.chats) {
      const li = LI.el("li", chat.id === data.current ? "current" : null, chat.title);
      li.title = chat.title;
      li.addEventListener("click", () => { if (!controller) { data.current = chat.id; save(); drawAll(); } });
      ul.appendChild(li);
    }
  }
  function drawMessage(m) {
    const box = LI.el("div", "msg " + m.role);
    box.appendChild(LI.el("div", "role", m.role === "user" ? "you" : model || "assistant"));
    const body = box.appendChild(LI.el("div", "body"));
    const calls = box.appendChild(LI.el("div", "calls"));
    const meta = box.appendChild(LI.el("div", "meta"));
    const view = {
      box, body, meta,
      update() {
        if (m.role === "assistant") LI.renderMarkdown(m.content, body);
        else body.textContent = m.content;
        calls.replaceChildren();
        for (const call of m.tool_calls || []) {
          const block = calls.appendChild(LI.el("div", "toolcall"));
          const head = block.appendChild(LI.el("div", "toolhead", "tool call: "));
          head.appendChild(LI.el("b", "toolname", call.name));
          block.appendChild(LI.el("pre", "toolargs")).appendChild(LI.el("code", null, call.arguments));
        }
        meta.textContent = m.meta || "";
        if (m.error) meta.appendChild(LI.el("span", "error", (m.meta ? " · " : "") + m.error));
      },
    };
    view.update();
    $("messages").appendChild(box);
    return view;
  }
  function drawAll() {
    const chat = current();
    $("system").value = chat.system || "";
    $("messages").replaceChildren();
    for (const m of chat.messages) drawMessage(m);
    drawList();
    scrollDown();
  }
  function scrollDown() { const el = $("messages"); el.scrollTop = el.scrollHeight; }
  function busy(on) {
    $("send").classList.toggle("hidden", on);
    $("stop").classList.toggle("hidden", !on);
    $("regen").disabled = on;
    $("newchat").disabled = on;
  }

  // ---- a reply -----------------------------------------------------------------
  async function reply(chat, extra) {
    const messages = [];
    if ((chat.system || "").trim()) messages.push({ role: "system", content: chat.system });
    for (const m of chat.messages) messages.push({ role: m.role, content: m.content });
    const msg = { role: "assistant", content: "", meta: "" };
    chat.messages.push(msg);
    const view = drawMessage(msg);
    controller = new AbortController();
    busy(true);
    $("status").textContent = "";
    const t0 = performance.now();
    let first = null, usage = null, finish = null, pending = false;
    const redraw = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => { pending = false; view.update(); scrollDown(); });
    };
    try {
      const body = Object.assign({ model: model || "default", messages, stream: true,
                                   stream_options: { include_usage: true } }, sampling(), extra);
      const res = await LI.api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
        headers: { "Content-Type": "application/json" }, signal: controller.signal });
      if (!res.ok) {
        msg.error = await LI.errorText(res);
      } else {
        const reader = res.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += dec.decode(value, { stream: true });
          for (let cut; (cut = buf.indexOf("\n\n")) >= 0;) {
            const frame = buf.slice(0, cut);
            buf = buf.slice(cut + 2);
            for (const line of frame.split("\n")) {
              if (!line.startsWith("data:")) continue;
              const text = line.slice(5).trim();
              if (text === "[DONE]") continue;
              const ev = JSON.parse(text);
              if (ev.error) { msg.error = ev.error.message; continue; }
              if (ev.usage) usage = ev.usage;
              const c = ev.choices && ev.choices[0];
              if (c && c.delta && c.delta.content) {
                if (first === null) first = performance.now();
                msg.content += c.delta.content;
                redraw();
              }
              for (const d of (c && c.delta && c.delta.tool_calls) || []) {
                if (first === null) first = performance.now();
                msg.tool_calls = msg.tool_calls || [];
                const call = (msg.tool_calls[d.index || 0] ||= { name: "", arguments: "" });
                if (d.function && d.function.name) call.name += d.function.name;
                if (d.function && d.function.arguments) call.arguments += d.function.arguments;
                redraw();
              }
              if (c && c.finish_reason) finish = c.finish_reason;
            }
          }
        }
      }
    } catch (e) {
      if (e.name === "AbortError") finish = "stopped";
      else msg.error = String(e.message || e);
    } finally {
      controller = null;
      const secs = (performance.now() - t0) / 1000;
      const parts = [];
      if (finish) parts.push(finish);
      if (usage) {
        parts.push(usage.completion_tokens + " tokens");
        const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
        parts.push(usage.prompt_tokens + " prompt" + (cached ? " (" + cached + " cached)" : ""));
      }
      if (first !== null) {
        parts.push("first token " + LI.fmt((first - t0) / 1000, 2) + " s");
        if (usage && usage.completion_tokens > 1 && secs > (first - t0) / 1000)
          parts.push(LI.fmt((usage.completion_tokens - 1) / (secs - (first - t0) / 1000), 1) + " tok/s");
      }
      msg.meta = parts.join(" · ");
      view.update();
      view.box.dataset.finish = finish || (msg.error ? "error" : "");
      save();
      busy(false);
      scrollDown();
    }
  }

  async function send() {
    const text = $("input").value;
    if (!text.trim() || controller) return;
    const extra = structured();
    if (!extra) { $("status").textContent = "fix the JSON schema / tools panel first"; return; }
    const chat = current();
    chat.system = $("system").value;
    if (!chat.messages.length) chat.title = text.trim().slice(0, 40);
    chat.messages.push({ role: "user", content: text });
    $("input").value = "";
    drawMessage(chat.messages[chat.messages.length - 1]);
    save();
    drawList();
    await reply(chat, extra);
  }

  async function regenerate() {
    const chat = current();
    if (controller || !chat.messages.length) return;
    const extra = structured();
    if (!extra) { $("status").textContent = "fix the JSON schema / tools panel first"; return; }
    if (chat.messages[chat.messages.length - 1].role === "assistant") chat.messages.pop();
    if (!chat.messages.length) return;
    save();
    drawAll();
    await reply(chat, extra);
  }

  async function connect() {
    const res = await LI.api("/v1/models");
    if (!res.ok) { $("model").textContent = await LI.errorText(res); return; }
    const card = (await res.json()).data[0];
    model = card.id;
    $("model").textContent = card.id + (card.max_model_len ? " · " + card.max_model_len + " tokens of context" : "");
  }

  document.addEventListener("DOMContentLoaded", () => {
    loadSettings();
    $("send").addEventListener("click", send);
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("regen").addEventListener("click", regenerate);
    $("newchat").addEventListener("click", () => { newChat(); drawAll(); });
    $("delchat").addEventListener("click", () => {
      if (controller) return;
      data.chats = data.chats.filter((c) => c.id !== data.current);
      data.current = data.chats.length ? data.chats[0].id : null;
      save();
      drawAll();
    });
    $("system").addEventListener("change", () => { current().system = $("system").value; save(); });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); send(); }
    });
    drawAll();
    connect();
  });
})();
