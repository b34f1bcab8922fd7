// kvgate console: the little the pages need beyond plain HTML forms. Loaded from /admin/static
// (the content security policy allows no inline script).
"use strict";

document.addEventListener("click", (event) => {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const source = document.getElementById(button.dataset.copy);
  if (!source || !navigator.clipboard) return;
  navigator.clipboard.writeText(source.textContent.trim()).then(
    () => { button.textContent = "Copied"; },
    () => { button.textContent = "Copy failed: select and copy"; });
});

document.addEventListener("submit", (event) => {
  const message = event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});

// Reload a fragment of our own server's HTML (the engine's live figures) every few seconds.
for (const box of document.querySelectorAll("[data-refresh]")) {
  const every = Math.max(1000, Number(box.dataset.every) || 2000);
  const refresh = async () => {
    try {
      const response = await fetch(box.dataset.refresh, {credentials: "same-origin", redirect: "error"});
      if (response.ok) box.innerHTML = await response.text();
    } catch (e) {
      // the next tick tries again; a signed-out session stops refreshing when the page is reloaded
    }
    setTimeout(refresh, every);
  };
  setTimeout(refresh, every);
}
