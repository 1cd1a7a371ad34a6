"""The console's widgets and screens, one per module."""
