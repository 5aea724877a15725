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
