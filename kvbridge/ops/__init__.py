"""Operations on pools: pages (encode, decode, transcode), slots, indexer keys, loss reports."""
