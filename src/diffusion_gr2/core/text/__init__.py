"""Text side of the re-ranker: prompt template, output parser, tokenizer, the reasoning-trace teacher.

Modules: `prompt` (ItemLookup, build_messages, render_answer), `parser` (parse_answer, apply_fallback),
`tokenizer` (build_tokenizer, extend_tokenizer, encode_example, decode_response), `traces`
(RuleBasedAnalyst, rejection_sample, build_sft_rows).
"""
