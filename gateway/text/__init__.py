"""Text and token ids over a served model's tokenizer, below the services: control tokens kept text, a
chat's segments reused by namespace, single tokens' text cached for logprobs."""
