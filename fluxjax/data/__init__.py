"""ShadowLoader on Grain: metadata, preprocessing workers, materializer."""
