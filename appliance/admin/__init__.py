"""The admin API's parts below the server: its wire schema (what the console reads), its
token file, and the device and latency readings it reports."""
