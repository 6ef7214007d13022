"""The controller's own health: the event loop's lag (`looplag`) and, when asked, where its stalls go (`stalls`).
Next: `/metrics` and the bench read them."""
