// Markdown for untrusted model text, built as DOM nodes: every piece of text goes in through textContent,
// never innerHTML, so no HTML in a reply reaches the page as markup.  Fenced code, headings, lists,
// block quotes, paragraphs; inline code, bold, italics and http(s) links.
"use strict";
(function () {
  const LI = (window.LI = window.LI || {});
  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*]+)\*\*|__([^_]+)__|\*([^*\s][^*]*)\*|\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g;

  function inline(parent, text) {
    const re = new RegExp(INLINE.source, "g");     // its own lastIndex: bold and italics recurse
    let last = 0;
    for (let m; (m = re.exec(text)) !== null;) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      if (m[2] !== undefined) parent.appendChild(LI.el("code", null, m[2]));
      else if (m[3] !== undefined || m[4] !== undefined) inline(parent.appendChild(LI.el("strong")), m[3] || m[4]);
      else if (m[5] !== undefined) inline(parent.appendChild(LI.el("em")), m[5]);
      else {
        const a = LI.el("a", null, m[6]);
        a.href = m[7];                      // http(s) only: the pattern admits no other scheme
        a.rel = "noopener noreferrer nofollow";
        a.target = "_blank";
        parent.appendChild(a);
      }
      last = re.lastIndex;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  }

  function lines(parent, rows) {          // a paragraph's lines, joined by <br>
    rows.forEach((row, i) => {
      if (i) parent.appendChild(document.createElement("br"));
      inline(parent, row);
    });
  }

  function codeBlock(lang, body) {
    const box = LI.el("div", "codeblock");
    const head = LI.el("div", "codehead");
    head.appendChild(LI.el("span", null, lang || "code"));
    const copy = LI.el("button", null, "copy");
    copy.type = "button";
    copy.addEventListener("click", () => navigator.clipboard && navigator.clipboard.writeText(body));
    head.appendChild(copy);
    box.appendChild(head);
    const pre = LI.el("pre");
    pre.appendChild(LI.el("code", lang ? "lang-" + lang.replace(/[^\w-]/g, "") : null, body));
    box.appendChild(pre);
    return box;
  }

  // Replace container's children with text rendered as markdown.
  LI.renderMarkdown = function (text, container) {
    const out = document.createDocumentFragment();
    const rows = String(text).replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    let list = null;
    const flush = () => {
      if (para.length) lines(out.appendChild(LI.el("p")), para);
      para = [];
    };
    for (let i = 0; i < rows.length; i++) {
      const row = rows[i];
      const fence = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/.exec(row);
      if (fence) {
        flush(); list = null;
        const body = [];
        let j = i + 1;
        while (j < rows.length && !rows[j].trim().startsWith(fence[1])) body.push(rows[j++]);
        out.appendChild(codeBlock(fence[2], body.join("\n")));   // an unclosed fence (still streaming) runs to the end
        i = j;
        continue;
      }
      const heading = /^(#{1,6})\s+(.*)$/.exec(row);
      if (heading) {
        flush(); list = null;
        inline(out.appendChild(LI.el("h" + Math.min(4, heading[1].length + 1))), heading[2]);
        continue;
      }
      const item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(row);
      if (item) {
        flush();
        const tag = /\d/.test(item[1]) ? "ol" : "ul";
        if (!list || list.tagName.toLowerCase() !== tag) list = out.appendChild(LI.el(tag));
        inline(list.appendChild(LI.el("li")), item[2]);
        continue;
      }
      const quote = /^\s*>\s?(.*)$/.exec(row);
      if (quote) {
        flush(); list = null;
        inline(out.appendChild(LI.el("blockquote")), quote[1]);
        continue;
      }
      if (!row.trim()) { flush(); list = null; continue; }
      list = null;
      para.push(row);
    }
    flush();
    container.replaceChildren(out);
  };
})();
