//go:build tools

// Package tools records the main packages hack/tools/build.sh compiles, so that
// `go mod tidy` keeps every module they need in go.mod and go.sum.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
