// SPDX-License-Identifier: MIT
//
// usage: node peer.js PORT INFLIGHT KEYS SECONDS
//
// rate-limiter-flexible's RateLimiterRedis on ioredis, the same workload as
// tokenbucket-redis-bench: INFLIGHT consume() calls outstanding at all
// times on one hot key or random keys out of KEYS, for SECONDS, with the
// same limit (1000 points per second).  Prints "decisions/s p50_us p99_us errors".
'use strict';
const Redis = require('ioredis');
const { RateLimiterRedis } = require('rate-limiter-flexible');

const [port, inflight, keys, seconds] = process.argv.slice(2).map(Number);
const redis = new Redis({ host: '127.0.0.1', port, enableOfflineQueue: true });
const limiter = new RateLimiterRedis({ storeClient: redis, points: 1000, duration: 1, keyPrefix: 'rlf' });
const lat = [];
let calls = 0;
let errors = 0;

async function worker(end) {
	while (Date.now() < end) {
		const key = keys > 1 ? String(Math.floor(Math.random() * keys)) : 'hot';
		const t0 = process.hrtime.bigint();
		try {
			await limiter.consume(key, 1);
		} catch (e) {
			if (e instanceof Error)
				errors++; // a refusal is a RateLimiterRes, not an Error
		}
		calls++;
		if (lat.length < 400000)
			lat.push(Number(process.hrtime.bigint() - t0));
	}
}

(async () => {
	await redis.ping();
	const start = Date.now();
	const end = start + seconds * 1000;
	await Promise.all(Array.from({ length: inflight }, () => worker(end)));
	const elapsed = (Date.now() - start) / 1000;
	lat.sort((a, b) => a - b);
	console.log(`${(calls / elapsed).toFixed(0)} ${(lat[lat.length >> 1] / 1e3).toFixed(1)} ` +
		`${(lat[Math.floor(lat.length * 0.99)] / 1e3).toFixed(1)} ${errors}`);
	redis.disconnect();
})();
