"""The OpenAI Responses API (POST /v1/responses): a request is read as the chat request it
amounts to (protocol.py), runs through the chat path, and its output is answered as response
output items, whole or as typed stream events (route.py)."""
