"""Images in the prompt: the checkpoint's vision tower and processor for the engine, and prompts with images expanded and embedded."""
