// localinfer's pages: the API key (asked once, kept in sessionStorage), fetch with it, small DOM helpers.
"use strict";
const LI = (window.LI = window.LI || {});
const KEY = "localinfer.apiKey";

LI.el = function (tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
};

LI.key = () => sessionStorage.getItem(KEY);

// The form in #keybox; resolves with the key typed (kept for this tab's session).
LI.askKey = function (message) {
  const box = document.getElementById("keybox");
  const input = document.getElementById("keyinput");
  const note = document.getElementById("keynote");
  note.textContent = message || "This server needs an API key (serve --api-key).";
  box.classList.remove("hidden");
  input.value = "";
  input.focus();
  return new Promise((resolve) => {
    const done = () => {
      const key = input.value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      box.classList.add("hidden");
      button.removeEventListener("click", done);
      input.removeEventListener("keydown", onKey);
      resolve(key);
    };
    const onKey = (ev) => { if (ev.key === "Enter") { ev.preventDefault(); done(); } };
    const button = document.getElementById("keysave");
    button.addEventListener("click", done);
    input.addEventListener("keydown", onKey);
  });
};

// fetch on this server with the key; a 401 asks for the key and tries again.
LI.api = async function (path, options) {
  for (let tries = 0; ; tries++) {
    const opts = Object.assign({}, options || {});
    const headers = Object.assign({}, opts.headers || {});
    const key = LI.key();
    if (key) headers["Authorization"] = "Bearer " + key;
    opts.headers = headers;
    const res = await fetch(path, opts);
    if (res.status !== 401 || tries > 4) return res;
    await LI.askKey(key ? "That key was refused; enter the server's API key." : undefined);
  }
};

// The message of an OpenAI-shaped error body, or the status line.
LI.errorText = async function (res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return res.status + ": " + body.error.message;
  } catch (e) { /* not JSON */ }
  return res.status + " " + res.statusText;
};

LI.fmt = function (v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return Number(v).toFixed(digits === undefined ? 0 : digits);
};
