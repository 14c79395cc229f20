"""The post room: what people do with a trained run (evaluate, merge, chat, report)."""
