"""engine-monitor: a Textual dashboard of the engine's steps (see monitor.app and monitor.source)."""
