// SPDX-License-Identifier: MIT

// Command peer runs the workloads of tokenbucket-bench on
// golang.org/x/time/rate, by the same method: each workload is calibrated
// once to a loop of about -ms milliseconds, every repetition runs one loop of
// each workload round-robin, and a workload reports the median, min and max
// of its repetitions in ns per operation.  Multi-threaded workloads start
// their goroutines behind a barrier and report the wall time from the first
// start to the last end, divided by the operations of one goroutine.
//
// Where Go differs in what a call costs (all of it what Go users pay):
//   - time.Now() reads the wall clock and the monotonic clock, so "clock" and
//     every call without an explicit time (Allow) pay for two clock reads;
//     the C side reads CLOCK_MONOTONIC once.
//   - A Limiter is one mutex around float64 state, so every call locks and
//     unlocks it; there is no separate take path, claim path or refusal path.
//   - ReserveN returns a *Reservation, a heap allocation per call; the garbage
//     collector's share of that lands in reserve_cancel.
//   - GOMAXPROCS is left at its default, the number of CPUs.
//
// Build it offline with Debian's golang-golang-x-time-dev:
//
//	GOPATH=/usr/share/gocode GO111MODULE=off go build -o peer peer.go
package main

import (
	"flag"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// A burst that never empties during a run.  A new Limiter holds no tokens
// and fills on its first call from the zero time, which saturates at
// math.MaxInt64 ns: about 9.2e9 tokens at 1 token/s, all of them exact in
// float64 since the burst caps nothing below 2^52.
const hugeBurst = 1 << 52

// Results are summed into this so that no call can be dropped.
var sink int

type expect int

const (
	anyResult expect = iota // the loop's sum means nothing
	allTrue                 // it is the number of calls: each took its path
	allFalse                // it is 0
)

// What one timed loop works on; goroutine i uses lim[i&1].
type ctx struct {
	lim [2]*rate.Limiter
	t0  time.Time
}

type metric struct {
	name    string
	threads int // 0: run in the calling goroutine
	setup   func(c *ctx)
	loop    func(c *ctx, id int, n int) int
	expect  expect

	on      bool
	warned  bool
	n       int
	samples []float64
}

func full(c *ctx) {
	c.lim[0] = rate.NewLimiter(1, hugeBurst)
	c.lim[1] = c.lim[0]
}

func full2b(c *ctx) {
	c.lim[0] = rate.NewLimiter(1, hugeBurst)
	c.lim[1] = rate.NewLimiter(1, hugeBurst)
}

// 1e9 tokens/s: every call 1 ns later finds one more token.
func claim(c *ctx) {
	c.lim[0] = rate.NewLimiter(1e9, 1000)
	c.lim[1] = c.lim[0]
}

// A byte rate through the clock: 1e15 per second, every call finds new tokens.
func fast(c *ctx) {
	c.lim[0] = rate.NewLimiter(1e15, 1000)
	c.lim[1] = c.lim[0]
}

// Empty, the next token a second away: every call is refused.
func emptyAt(c *ctx) {
	c.lim[0] = rate.NewLimiter(1, 1)
	c.lim[1] = c.lim[0]
	if !c.lim[0].AllowN(c.t0.Add(-1), 1) {
		fail("draining a limiter")
	}
}

func emptyNow(c *ctx) {
	c.lim[0] = rate.NewLimiter(1, 1)
	c.lim[1] = c.lim[0]
	if !c.lim[0].Allow() {
		fail("draining a limiter")
	}
}

func loopClock(c *ctx, id int, n int) int {
	sum := 0
	for i := 0; i < n; i++ {
		sum += time.Now().Nanosecond()
	}
	return sum
}

func loopAllow(c *ctx, id int, n int) int {
	lim := c.lim[id&1]
	sum := 0
	for i := 0; i < n; i++ {
		if lim.Allow() {
			sum++
		}
	}
	return sum
}

func loopAllowAt(c *ctx, id int, n int) int {
	lim := c.lim[id&1]
	sum := 0
	t := c.t0
	for i := 0; i < n; i++ {
		if lim.AllowN(t, 1) {
			sum++
		}
		t = t.Add(1)
	}
	return sum
}

func loopReserveCancel(c *ctx, id int, n int) int {
	lim := c.lim[id&1]
	sum := 0
	t := c.t0
	for i := 0; i < n; i++ {
		r := lim.ReserveN(t, 1)
		if r.OK() {
			sum++
		}
		r.CancelAt(t)
		t = t.Add(1)
	}
	return sum
}

var metrics = []*metric{
	{name: "clock", loop: loopClock},
	{name: "allow", setup: full, loop: loopAllow, expect: allTrue},
	{name: "allow_at", setup: full, loop: loopAllowAt, expect: allTrue},
	{name: "allow_at_claim", setup: claim, loop: loopAllowAt, expect: allTrue},
	{name: "deny", setup: emptyNow, loop: loopAllow, expect: allFalse},
	{name: "deny_at", setup: emptyAt, loop: loopAllowAt, expect: allFalse},
	{name: "reserve_cancel", setup: full, loop: loopReserveCancel, expect: allTrue},
	{name: "allow_claim", setup: fast, loop: loopAllow, expect: allTrue},
	{name: "allow_2t", threads: 2, setup: full, loop: loopAllow, expect: allTrue},
	{name: "allow_4t", threads: 4, setup: full, loop: loopAllow, expect: allTrue},
	{name: "allow_2t_claim", threads: 2, setup: fast, loop: loopAllow, expect: allTrue},
	{name: "allow_4t_claim", threads: 4, setup: fast, loop: loopAllow, expect: allTrue},
	{name: "allow_at_2b", threads: 2, setup: full2b, loop: loopAllowAt, expect: allTrue},
	{name: "allow_at_shared", threads: 2, setup: full, loop: loopAllowAt, expect: allTrue},
}

func fail(what string) {
	fmt.Fprintf(os.Stderr, "peer: %s\n", what)
	os.Exit(1)
}

// run times one loop of n iterations (in each goroutine) on fresh state.
func run(m *metric, n int) time.Duration {
	c := &ctx{t0: time.Now()}
	if m.setup != nil {
		m.setup(c)
	}
	var start, end time.Time
	sum := 0
	if m.threads == 0 {
		start = time.Now()
		sum = m.loop(c, 0, n)
		end = time.Now()
	} else {
		type result struct {
			start, end time.Time
			sum        int
		}
		results := make([]result, m.threads)
		var ready, done sync.WaitGroup
		gate := make(chan struct{})
		ready.Add(m.threads)
		done.Add(m.threads)
		for i := 0; i < m.threads; i++ {
			go func(id int) {
				defer done.Done()
				ready.Done()
				<-gate
				s := time.Now()
				k := m.loop(c, id, n)
				results[id] = result{s, time.Now(), k}
			}(i)
		}
		ready.Wait()
		close(gate)
		done.Wait()
		start, end = results[0].start, results[0].end
		for _, r := range results {
			if r.start.Before(start) {
				start = r.start
			}
			if r.end.After(end) {
				end = r.end
			}
			sum += r.sum
		}
	}
	calls := n
	if m.threads > 0 {
		calls *= m.threads
	}
	if !m.warned && ((m.expect == allTrue && sum != calls) || (m.expect == allFalse && sum != 0)) {
		other := sum
		if m.expect == allTrue {
			other = calls - sum
		}
		fmt.Fprintf(os.Stderr, "peer: warning: %s: %d of %d calls did not take the path measured\n",
			m.name, other, calls)
		m.warned = true
	}
	sink += sum
	return end.Sub(start)
}

// calibrate returns the iterations for a loop of target; the first loops double as warm-up.
func calibrate(m *metric, target time.Duration) int {
	n := 256
	for {
		t := run(m, n)
		if t >= target/4 || n >= 1<<40 {
			if t <= 0 {
				t = 1
			}
			scaled := int(float64(n) * float64(target) / float64(t))
			if scaled < 1 {
				scaled = 1
			}
			return scaled
		}
		if t < target/64 {
			n *= 16
		} else {
			n *= 4
		}
	}
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func minMax(v []float64) (float64, float64) {
	lo, hi := v[0], v[0]
	for _, x := range v[1:] {
		if x < lo {
			lo = x
		}
		if x > hi {
			hi = x
		}
	}
	return lo, hi
}

func main() {
	reps := flag.Int("r", 11, "repetitions per workload")
	ms := flag.Float64("ms", 20, "length of one repetition in milliseconds")
	filter := flag.String("filter", "", "only the workloads whose name contains this")
	tsv := flag.Bool("tsv", false, "print metric<TAB>median<TAB>min<TAB>max lines")
	flag.Parse()
	if flag.NArg() > 0 || *reps < 1 || !(*ms > 0) {
		flag.Usage()
		os.Exit(2)
	}

	on := 0
	for _, m := range metrics {
		m.on = strings.Contains(m.name, *filter)
		if m.on {
			on++
		}
	}
	if on == 0 {
		fail(fmt.Sprintf("no workload matches %q", *filter))
	}
	target := time.Duration(*ms * 1e6)
	for _, m := range metrics {
		if m.on {
			m.n = calibrate(m, target)
		}
	}
	// Round-robin: repetition r of every workload before repetition r + 1 of any.
	for r := 0; r < *reps; r++ {
		for _, m := range metrics {
			if m.on {
				m.samples = append(m.samples, float64(run(m, m.n))/float64(m.n))
			}
		}
	}

	if !*tsv {
		fmt.Printf("golang.org/x/time/rate, %d repetitions of ~%g ms per workload, interleaved\n", *reps, *ms)
		fmt.Printf("ns per operation; spread = (max - min) / median\n\n")
		fmt.Printf("%-16s| %10s | %9s | %9s | %7s\n", "workload", "median ns", "min", "max", "spread")
		fmt.Printf("----------------+------------+-----------+-----------+--------\n")
	}
	for _, m := range metrics {
		if !m.on {
			continue
		}
		med := median(m.samples)
		lo, hi := minMax(m.samples)
		if *tsv {
			fmt.Printf("%s\t%.3f\t%.3f\t%.3f\n", m.name, med, lo, hi)
		} else {
			fmt.Printf("%-16s| %10.2f | %9.2f | %9.2f | %6.1f%%\n", m.name, med, lo, hi, 100*(hi-lo)/med)
		}
	}
}
