"""Engine adapters: glue that lets an unmodified inference engine exchange DeepSeek-V4 requests with kvbridge."""
