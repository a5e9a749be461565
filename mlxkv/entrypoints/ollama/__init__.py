"""Ollama's API: request bodies and error shape (`protocol`), and the endpoints (`serving`)."""
