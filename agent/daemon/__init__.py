"""The node daemon: a warm process serving the plugin, the hooks and the pin socket."""
