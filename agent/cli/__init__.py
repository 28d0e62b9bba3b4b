"""The `tfimage` command: operators' commands, doctor, and the plugin's hidden ones."""
