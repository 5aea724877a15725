// The console's own behaviour, as a file: the Content-Security-Policy runs no inline script
// (no <script> blocks, no hx-on or onclick attributes) and htmx runs with allowEval off.
// Templates ask for behaviour with data- attributes.

// <form data-reset-on-success>: after htmx submitted it and the server accepted it, clear it
// (the bulk replay's reason must not be reused by accident for the next selection).
document.addEventListener("htmx:afterRequest", (event) => {
  const form = event.detail.elt;
  if (form instanceof HTMLFormElement && form.hasAttribute("data-reset-on-success")
      && event.detail.successful) {
    form.reset();
  }
});

// Keyboard shortcuts (the help is the <dialog id="shortcuts-help"> of base.html):
// j/k move through the inbox's rows, Enter/o opens one, x selects it, c claims it,
// a/r go to the approval's or rejection's reason (of the open step, or the current row's),
// Ctrl+Enter in a reason submits its decision, / searches, ? shows the help.
(() => {
  const rows = () => Array.from(document.querySelectorAll('[data-testid="inbox-row"]'));
  let currentStep = null;

  const current = () => rows().find((row) => row.dataset.step === currentStep) || null;

  const mark = (row) => {
    for (const other of rows()) {
      other.classList.remove("is-current");
      other.removeAttribute("aria-current");
    }
    if (!row) return;
    currentStep = row.dataset.step;
    row.classList.add("is-current");
    row.setAttribute("aria-current", "true");
    const link = row.querySelector("a.step-key");
    if (link) link.focus({ preventScroll: true });
    row.scrollIntoView({ block: "nearest" });
  };

  const move = (by) => {
    const all = rows();
    if (!all.length) return;
    const at = all.indexOf(current());
    const next = at < 0 ? (by > 0 ? 0 : all.length - 1) : Math.min(all.length - 1, Math.max(0, at + by));
    mark(all[next]);
  };

  // After a list refresh the same step stays current, if it is still listed.
  document.addEventListener("htmx:afterSwap", () => {
    const row = current();
    if (row) row.classList.add("is-current");
  });

  const focusReason = (name) => {
    const field = document.getElementById(`${name}-reason`);
    if (!field) return false;
    field.focus();
    field.scrollIntoView({ block: "center" });
    return true;
  };

  // Opened from the inbox with "a" or "r": the page opens at that decision's reason.
  const fromHash = () => {
    const name = { "#approve": "approve", "#reject": "reject" }[window.location.hash];
    if (name) focusReason(name);
  };
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", fromHash);
  } else {
    fromHash();
  }

  const typing = (target) =>
    target instanceof HTMLElement &&
    (target.isContentEditable || ["INPUT", "TEXTAREA", "SELECT"].includes(target.tagName));

  document.addEventListener("keydown", (event) => {
    const target = event.target;
    // Ctrl/Cmd+Enter in a reason submits the decision it belongs to.
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey) && target instanceof HTMLTextAreaElement) {
      const form = target.form;
      if (form) {
        event.preventDefault();
        form.requestSubmit();
      }
      return;
    }
    if (event.key === "Escape" && typing(target)) {
      target.blur();
      return;
    }
    if (typing(target) || event.ctrlKey || event.metaKey || event.altKey) return;
    const help = document.getElementById("shortcuts-help");
    const row = current();
    switch (event.key) {
      case "j":
        move(1);
        break;
      case "k":
        move(-1);
        break;
      case "Enter":
      case "o":
        if (!row || target instanceof HTMLButtonElement) return;
        window.location.href = row.dataset.href;
        break;
      case "x": {
        const box = row && row.querySelector('input[type="checkbox"]');
        if (!box) return;
        box.checked = !box.checked;
        break;
      }
      case "c": {
        const claim = (row || document).querySelector('[data-testid="claim"]');
        if (!claim) return;
        claim.click();
        break;
      }
      case "a":
      case "r": {
        const name = event.key === "a" ? "approve" : "reject";
        if (focusReason(name)) break;
        if (!row || !row.hasAttribute("data-decidable")) return;
        window.location.href = `${row.dataset.href}#${name}`;
        break;
      }
      case "/": {
        const search = document.querySelector("[data-shortcut-search]");
        if (!search) return;
        search.focus();
        search.select();
        break;
      }
      case "?":
        if (!help || help.open) return;
        help.showModal();
        break;
      default:
        return;
    }
    event.preventDefault();
  });

  document.addEventListener("click", (event) => {
    const opener = event.target instanceof Element && event.target.closest("[data-shortcut-help]");
    const help = document.getElementById("shortcuts-help");
    if (opener && help) help.showModal();
  });
})();
