"""The main job behind `shardwise demo`: a character-level GPT trained on a (dp, tp) mesh."""
