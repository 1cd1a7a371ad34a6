"""`appliance bench`: load against OpenAI-compatible endpoints; comparing pool layouts."""
