"""The engine's front end: the offline `LLM` and the served `AsyncLLM`, with what they share
(tokenizer, chat template, detokenizer, output processing, structured output)."""
